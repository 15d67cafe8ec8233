"""The compact summary of bench/accelerator.sh: read its results folder, print the accelerator table and the
parity verdicts, and write ``summary.md`` (the table docs/results.md holds) and ``summary.json``.

    python bench/accelerator_summary.py bench/results/accelerator
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _first_line(error: str | None) -> str:
    return (error or "").strip().splitlines()[0][:160] if error else ""


def parity_rows(results: Path) -> list[dict[str, Any]]:
    rows = []
    for precision in ("fp32", "bf16-mixed"):
        record = _json(results / f"parity-{precision}.json")
        if record is None:
            rows.append({"precision": precision, "target": "-", "verdict": "no result (see log.txt)"})
            continue
        for row in record["targets"]:
            rows.append({"precision": precision, "target": row["target"], "verdict": row["verdict"],
                         "max_loss_dev": row.get("max_loss_dev"), "loss_limit": row.get("loss_limit"),
                         "max_param_dev": row.get("max_param_dev"), "param_limit": row.get("param_limit"),
                         "error": _first_line(row.get("error"))})
    return rows


def compare_rows(results: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    record = _json(results / "compare.json")
    if record is None:
        return [], None
    rows = []
    for row in record["targets"]:
        m = row.get("metrics") or {}
        rows.append({"target": row["target"], "status": row["status"], "error": _first_line(row.get("error")),
                     **{k: m.get(k) for k in ("compile_s", "step_ms_median", "tokens_per_s", "achieved_tflops",
                                              "mfu", "peak_source", "device_peak_mib", "max_loss_dev",
                                              "loss_parity", "recompiles")}})
    return rows, record


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown(gpu: str, versions: str, compare: list[dict[str, Any]], record: dict[str, Any] | None,
             parity: list[dict[str, Any]]) -> str:
    lines = [f"GPU: {gpu or 'unknown'}. Versions: {', '.join(versions.splitlines())}."]
    if record is not None:
        lines.append(f"Program `{record['program_file']}` ({record['program']}, {record['precision']}, "
                     f"{record['options']['steps']} steps of which {record['options']['warmup']} warm-up, "
                     f"{record['flops_per_step'] / 1e12:.2f} TFLOP per step), reference {record['reference']}.")
    lines += ["", "| target | compile (s) | step (ms) | tokens/s | TFLOP/s | MFU | device peak (GiB) | "
                  "loss dev vs eager (step) | parity |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in compare:
        if r["status"] != "ok":
            lines.append(f"| {r['target']} | {r['status']}: {r['error']} | | | | | | | |")
            continue
        lines.append(f"| {r['target']} | {_fmt(r['compile_s'], '.1f')} | {_fmt(r['step_ms_median'], '.1f')} | "
                     f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['achieved_tflops'], '.0f')} | "
                     f"{_fmt(r['mfu'], '.1%')} | "
                     f"{_fmt(None if r['device_peak_mib'] is None else r['device_peak_mib'] / 1024, '.1f')} | "
                     f"{_fmt(r['max_loss_dev'], '.2e')} | "
                     f"{'pass' if r['loss_parity'] else 'FAIL' if r['loss_parity'] is not None else '-'} |")
    if compare:
        lines.append(f"\nMFU against {compare[0].get('peak_source') or 'unknown'}.")
    lines += ["", "| parity (programs/gpt.py) | target | verdict | max loss dev (limit) | max param dev (limit) |",
              "| --- | --- | --- | --- | --- |"]
    for r in parity:
        if r["verdict"] in ("pass", "FAIL"):
            lines.append(f"| {r['precision']} | {r['target']} | {r['verdict']} | {r['max_loss_dev']:.2e} "
                         f"({r['loss_limit']:.2g}) | {r['max_param_dev']:.2e} ({r['param_limit']:.2g}) |")
        else:
            lines.append(f"| {r['precision']} | {r['target']} | {r['verdict']} {r.get('error', '')} | | |")
    return "\n".join(lines) + "\n"


def main(results: Path) -> int:
    gpu, versions = _text(results / "gpu.txt"), _text(results / "versions.txt")
    parity = parity_rows(results)
    compare, record = compare_rows(results)
    text = markdown(gpu, versions, compare, record, parity)
    (results / "summary.md").write_text(text)
    (results / "summary.json").write_text(json.dumps({"gpu": gpu, "versions": versions.splitlines(),
                                                      "compare": compare, "parity": parity}, indent=2))
    print(text)
    profile = _text(results / "profile.txt")
    if profile:
        print(profile)
    return 0 if compare and all(r["status"] == "ok" for r in compare) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/accelerator")))
