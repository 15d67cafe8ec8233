"""What the bench scripts that race one program under two or more settings share: one ``xbridge compare`` in a
subprocess, its JSON record back, and each target's row reduced to the figures the tables print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def compare(program: str, steps: int, backends: str, out: Path, *extra: str) -> dict[str, Any]:
    """``xbridge compare PROGRAM --steps N --backends B --out OUT EXTRA...``; exits with its stderr if it failed as
    a whole (a failed target is a row with an error, not a failure of the bench)."""
    cmd = [sys.executable, "-m", "xbridge", "compare", program, "--steps", str(steps), "--backends", backends,
           "--format", "json", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"compare {' '.join(extra)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def row_figures(row: dict[str, Any]) -> dict[str, Any]:
    """A compare row as the bench tables print it: step time, memory (device, else host RSS; and the RSS the steps
    added), final loss, error."""
    m = row.get("metrics")
    return {"target": row["target"], "status": row["status"],
            "step_ms": m["step_ms_median"] if m else None,
            "memory_mib": (m["device_peak_mib"] or m["peak_host_rss_mib"]) if m else None,
            "memory_kind": ("device" if m and m["device_peak_mib"] else "host RSS") if m else None,
            # on CPU: what the steps added to the process's peak RSS (the model built and placed before them)
            "steps_rss_mib": m.get("steps_host_rss_mib") if m else None,
            "final_loss": m["final_loss"] if m else None,
            "error": (row.get("error") or "").splitlines()[0] if not m else None}


def race(program: str, steps: int, backends: str, out: Path, setting: str, values: tuple[str, ...]) -> list[dict]:
    """One compare per value of ``--SETTING`` (one after the other), each target's row with its step time as a
    ratio to the same target's under ``values[0]`` (``step_vs_<values[0]>``, a ratio within one run); prints the
    table and writes ``out/<setting>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    record: dict[str, Any] = {}
    for value in values:
        record = compare(program, steps, backends, out / value, f"--{setting}", value)
        rows += [{**row_figures(row), setting: value} for row in record["targets"]]
    ratio = f"step_vs_{values[0].replace('-', '')}"
    base = {r["target"]: r["step_ms"] for r in rows if r[setting] == values[0] and r["step_ms"]}
    for r in rows:
        r[ratio] = r["step_ms"] / base[r["target"]] if r["target"] in base and r["step_ms"] else None
    print(f"{'target':14} {setting:11} {'step ms':>9} {'vs ' + values[0]:>11} {'memory MiB':>11} {'steps MiB':>10} "
          f"{'final loss':>11}")
    for r in rows:
        if r["step_ms"] is None:
            print(f"{r['target']:14} {r[setting]:11} error: {r['error']}")
            continue
        added = "-" if r["steps_rss_mib"] is None else f"{r['steps_rss_mib']:.0f}"
        print(f"{r['target']:14} {r[setting]:11} {r['step_ms']:9.1f} {r[ratio]:11.2f} {r['memory_mib']:11.0f} "
              f"{added:>10} {r['final_loss']:11.4f}")
    path = out / f"{setting}.json"
    path.write_text(json.dumps({"program": program, "steps": steps, "machine": record.get("machine"), "rows": rows},
                               indent=2))
    print(f"wrote {path}")
    return rows
