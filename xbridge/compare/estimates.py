"""``compare --topology T``: a target this machine cannot run but can compile for (jax-tpu) gets a compile-only row:
``xbridge compile`` in its own process, and from its record the compile time, the train step's bytes per chip
against HBM, whether it fits, and the roofline bound and MFU ceiling. Every figure but the compile time and the
bytes is an estimate; the rows are kept apart from the measured ones (their own table, section and JSON key)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..aot.record import TRAIN
from ..errors import ConfigError
from ..processes import warm
from ..run.isolated import ChildOptions


@dataclass
class EstimateRow:
    target: str                      # as asked, variant included (jax-tpu:sharding-mode=shard_map)
    topology: str
    command: list[str]
    status: str                      # ok, failed, timeout
    error: str | None = None
    chips: int | None = None
    compile_s: float | None = None   # the train step's lowering and compilation, measured here
    need_bytes: int | None = None    # the train step's, per chip
    hbm_bytes: int | None = None
    fits: bool | None = None
    step_bound_ms: float | None = None   # estimate: the roofline's lower bound
    mfu_ceiling: float | None = None     # estimate
    record: dict[str, Any] | None = None     # xbridge compile's whole record

    @property
    def error_line(self) -> str:
        return self.error.splitlines()[0] if self.error else ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "estimate": True}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EstimateRow:
        return cls(**{k: v for k, v in data.items() if k != "estimate"})


def compile_only(targets: list[str], topology: str | None) -> list[str]:
    """The requested targets that are compiled rather than run: those whose device is not here but which their
    backend can compile for (--topology given); without --topology none."""
    if topology is None:
        return []
    from ..aot.compile import resolve
    from ..contract import registry

    found = []
    for entry in targets:
        target_text = entry.split(":")[0]
        try:
            target, backend, _ = resolve(target_text)
        except ConfigError:
            continue
        if backend.unavailable_reason(target.device) is not None:
            found.append(entry)
    if not found:
        able = [t for t in registry.known_targets() if t.endswith("-tpu")]
        raise ConfigError(f"--topology {topology}: no target of --backends is compiled for it (give one that runs "
                          f"elsewhere, e.g. {', '.join(able) or 'jax-tpu'})")
    return found


def compile_command(program_ref: str, entry: str, topology: str, options: ChildOptions, out: Path) -> list[str]:
    target_text, *parts = entry.split(":")
    flags = [arg for part in parts for name, _, value in [part.partition("=")] for arg in (f"--{name}", value)]
    cmd = [sys.executable, "-m", "xbridge", "compile", program_ref, "--backend", target_text, *flags, "--topology",
           topology, "--format", "json", "--out", str(out)]
    for flag, value in (("--precision", options.precision), ("--mesh", options.mesh), ("--rng", options.rng),
                        ("--remat", options.remat), ("--attention", options.attention)):
        if value:
            cmd += [flag, value]
    return cmd


def estimate(program_ref: str, entry: str, topology: str, options: ChildOptions, out: Path) -> EstimateRow:
    """``xbridge compile`` for ``entry`` in a process of its own (its libtpu settings stay in it): a fresh
    interpreter, or a warm server's fork (xbridge/processes/warm.py)."""
    cmd = compile_command(program_ref, entry, topology, options, out / entry)
    row = EstimateRow(entry, topology, cmd, "ok")
    try:
        env = {**os.environ, "XBRIDGE_DEBUG": "0"}
        proc = warm.capture(cmd, env, timeout=options.timeout_s)
    except subprocess.TimeoutExpired:
        row.status, row.error = "timeout", f"no result after {options.timeout_s:g} s"
        return row
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1].removeprefix("error: ")
        row.status, row.error = "failed", f"exit code {proc.returncode}: {last}\n{proc.stderr[-2000:]}"
        return row
    record = json.loads(proc.stdout)
    train = record["per_chip"][TRAIN]
    bound = record.get("roofline") or {}
    row.record, row.chips, row.hbm_bytes = record, record["topology"]["chips"], train["hbm_bytes"]
    row.compile_s = round(train["lower_s"] + train["compile_s"], 3)
    row.need_bytes, row.fits = train["need_bytes"], record["fits"]
    row.step_bound_ms = bound["step_s"] * 1e3 if bound.get("step_s") else None
    row.mfu_ceiling = bound.get("mfu_ceiling")
    return row
