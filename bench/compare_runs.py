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
    """A compare row as the bench tables print it: step time, memory (device, else host RSS), final loss, error."""
    m = row.get("metrics")
    return {"target": row["target"], "status": row["status"],
            "step_ms": m["step_ms_median"] if m else None,
            "memory_mib": (m["device_peak_mib"] or m["peak_host_rss_mib"]) if m else None,
            "memory_kind": ("device" if m and m["device_peak_mib"] else "host RSS") if m else None,
            "final_loss": m["final_loss"] if m else None,
            "error": (row.get("error") or "").splitlines()[0] if not m else None}
