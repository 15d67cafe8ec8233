"""``xbridge check`` for the targets another environment runs (xbridge/environments.py): the same command there, for
those targets, with the same program and options; its verdicts join this one's record in the order asked."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from ..contract.checks import Finding
from ..environments import ALONE, Environment, handed_down
from ..processes import warm
from .record import TargetCheck


def check_there(env: Environment, program_path: str, targets: dict[str, str], flags: list[str],
                timeout_s: float = 900.0) -> list[TargetCheck]:
    """``xbridge check`` in ``env`` for ``targets`` (label -> the name there); a failure there is each target's
    ``fails`` verdict, with the environment's error line."""
    cmd = [env.python, "-m", "xbridge", "check", program_path, "--backends", ",".join(targets.values()), *flags,
           "--format", "json"]
    try:
        env_there = {**os.environ, **ALONE, **handed_down(), "XBRIDGE_DEBUG": "0"}
        proc = warm.capture(cmd, env_there, timeout=timeout_s)
        rows: list[dict[str, Any]] = json.loads(proc.stdout)["targets"] if proc.returncode == 0 else []
        failure = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        rows, failure = [], f"{type(exc).__name__}: {exc}"
    if failure:
        why = f"will not run: environment {env.name!r} ({env.python}) could not check it: {failure}"
        return [TargetCheck(label, "fails", why, {}) for label in targets]
    by_name = {row["target"]: row for row in rows}
    out = []
    for label, name in targets.items():
        row = by_name.get(name) or next(iter(rows), None)
        if row is None:
            out.append(TargetCheck(label, "fails", f"environment {env.name!r} gave no verdict", {}))
            continue
        out.append(TargetCheck(label, row["verdict"], row["summary"], row["operators"],
                               [Finding(**finding) for finding in row.get("findings", [])]))
    return out
