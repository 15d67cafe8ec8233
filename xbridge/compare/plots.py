"""PNG plots of a comparison (matplotlib, headless): loss curves overlaid, step time with p10/p90 whiskers, MFU."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw(out: Path, record: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in record["targets"] if r["status"] == "ok"]
    title = f"{record['program']} ({record['precision']}, config {record['config_hash']})"
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in ok:
        ax.plot(range(len(row["losses"])), row["losses"], label=row["target"], linewidth=1.5, alpha=0.85)
    ax.set(xlabel="step", ylabel="loss", title=f"loss: {title}")
    ax.grid(alpha=0.3)
    if ok:
        ax.legend()
    paths.append(_save(fig, out / "loss.png"))

    names = [r["target"] for r in ok]
    median = [r["metrics"]["step_ms_median"] for r in ok]
    low = [r["metrics"]["step_ms_median"] - r["metrics"]["step_ms_p10"] for r in ok]
    high = [r["metrics"]["step_ms_p90"] - r["metrics"]["step_ms_median"] for r in ok]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, median, yerr=[low, high], capsize=6, color="tab:blue", alpha=0.8)
    ax.set(ylabel="step time, ms (median, whiskers p10-p90)", title=f"step time: {title}")
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "step_time.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, [100 * r["metrics"]["mfu"] for r in ok], color="tab:green", alpha=0.8)
    ax.set(ylabel="MFU, % of peak", title=f"model FLOPs utilisation: {title}")
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "mfu.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
