"""PNG plots of a comparison (matplotlib, headless): each target's loss deviation from the reference per step (log
scale, with the parity limit), step time with p10/p90 whiskers, MFU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .record import CompareRecord


def draw(out: Path, record: CompareRecord) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [r for r in record.targets if r.status == "ok"]
    title = f"{record.program} ({record.precision}, config {record.config_hash})"
    paths = []

    # Overlaid loss curves hide everything that matters (they lie on top of each other): the relative deviation
    # from the reference per step, on a log scale, with the limit parity holds them to
    reference = next((r for r in ok if r.target == record.reference), None)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    floor = 1e-10                     # an exact match (0) is drawn at the floor
    if reference is not None:
        ref = reference.losses or []
        for row in ok:
            losses = row.losses or []
            if row is reference or len(losses) != len(ref):
                continue
            dev = [max(abs(a - b) / max(abs(b), 1e-30), floor) for a, b in zip(losses, ref)]
            ax.plot(range(len(dev)), dev, marker="o", markersize=3, label=row.target, linewidth=1.2)
        limit = record.loss_limit
        if limit:
            ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"parity limit ({limit:.0e})")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ref_name = record.reference
    ax.set(xlabel="step (an exact match is drawn at 1e-10)",
           ylabel=f"|loss - {ref_name} loss| / |{ref_name} loss|", title=f"loss deviation from {ref_name}: {title}")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "loss_deviation.png"))

    names = [r.target for r in ok]
    metrics = [r.finished for r in ok]
    median = [m.step_ms_median for m in metrics]
    low = [m.step_ms_median - m.step_ms_p10 for m in metrics]
    high = [m.step_ms_p90 - m.step_ms_median for m in metrics]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, median, yerr=[low, high], capsize=6, color="tab:blue", alpha=0.8)
    ax.set(ylabel="step time, ms (median, whiskers p10-p90)", title=f"step time: {title}")
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "step_time.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, [100 * m.mfu for m in metrics], color="tab:green", alpha=0.8)
    ax.set(ylabel="MFU, % of the peak FLOP/s", title=f"model FLOPs utilisation: {title}")
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "mfu.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from ..files import write_atomic

    fig.tight_layout()
    write_atomic(path, lambda handle: fig.savefig(handle, dpi=110, format="png"), mode="wb")
    plt.close(fig)
    return path
