"""One target in its own ``xbridge run`` subprocess: what compare and parity share.

Process isolation is the point: runtimes and their environment (``XLA_FLAGS``, ``PJRT_DEVICE``,
``CPU_NUM_DEVICES``) are per process, and a target that crashes, hangs or runs out of memory is reported as such
(with the tail of its stderr) while the others complete. A target entry may carry backend options,
``TARGET:OPTION=VALUE`` (e.g. ``xla-cpu:xla-mode=openxla``), so that one compare races two ways of reaching the
same compiler; the options are checked against what the backend declares.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..contract import registry
from ..environments import handed_down, locate, split_env
from ..errors import ConfigError
from ..processes import warm
from .record import RunRecord

REFERENCE = "eager-cpu"     # the default baseline of parity and compare (--reference picks another eager target)


@dataclass
class ChildOptions:
    """What every target's ``xbridge run`` gets."""

    steps: int
    warmup: int
    devices: int = 1
    precision: str | None = None
    mesh: str | None = None
    timeout_s: float = 900.0
    extra: list[str] = field(default_factory=list)      # more ``run`` arguments
    rng: str | None = None
    remat: str | None = None
    attention: str | None = None
    tensorboard: Path | None = None      # each target's scalars under TENSORBOARD/<target> (one TensorBoard run each)
    processes: int = 1       # --processes: targets that can run as this many processes of ``devices`` each; the
                             # others run the same total device count in one process


@dataclass
class TargetRun:
    """How one target's process ended; ``result`` is its run record when it finished."""

    target: str
    devices: int
    command: list[str]
    status: str                     # ok, failed, timeout
    error: str | None = None        # first line: why; then the tail of its stderr
    result: RunRecord | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"target": self.target, "devices": self.devices, "command": self.command,
                                "status": self.status}
        if self.error is not None:
            data["error"] = self.error
        if self.result is not None:
            data["result"] = self.result.to_json()
        return data


def available_targets(reference: str = REFERENCE) -> list[str]:
    """Every target that runs here or in a configured environment (xbridge/environments.py), the reference first."""
    from ..environments import available_targets as everywhere

    return sorted(everywhere(), key=lambda t: (t != reference, t))


def resolve_reference(text: str) -> str:
    """The baseline target of parity and compare (``--reference``): an eager target that can run here, e.g.
    ``eager-cuda`` on a GPU machine, where a CPU reference of a GPU-sized model would take hours; ``eager-cpu@NAME``
    takes the reference in environment NAME (another torch)."""
    parsed = registry.parse_target(split_env(text)[0])
    if (parsed if isinstance(parsed, str) else parsed.backend) != "eager":
        raise ConfigError(f"--reference {text!r}: the reference must be an eager target (eager-cpu, eager-cuda); "
                          "the compiled stacks are what is being checked against it")
    located = locate(text)
    return located.label if "@" in text else str(located.target)


def split_variant(entry: str) -> tuple[str, list[str]]:
    """``TARGET[@ENV][:OPTION=VALUE...]`` -> the target's label (canonical, with ``@ENV`` where it runs in another
    environment) and its ``run`` flags."""
    target_text, *parts = entry.split(":")
    located = locate(target_text)
    given: dict[str, str] = {}
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"target variant {entry!r}: {part!r} is not OPTION=VALUE (e.g. xla-cpu:xla-mode=openxla)")
        key = name.replace("-", "_")
        if key in given:
            raise ConfigError(f"target variant {entry!r}: {name} is given twice ({given[key]!r} and {value!r}); "
                              "give it once, or list two variants to race both")
        given[key] = value
    try:
        located.backend.resolve_options(given, str(located.target))
    except ConfigError as exc:
        raise ConfigError(f"target variant {entry!r}: {exc}") from None
    label = str(located.target) if "@" not in target_text else located.label
    return label, [arg for name, value in given.items() for arg in ("--" + name.replace("_", "-"), value)]


def averages_shard_losses(entry: str) -> bool:
    """Whether target ``entry`` (with its variant options) averages per-device losses over a split batch (torch DDP's
    semantics) instead of taking the loss over the global batch (:meth:`Backend.averages_shard_losses`)."""
    target_text, *parts = entry.split(":")
    located = locate(target_text)
    given = {name.replace("-", "_"): value for name, _, value in (part.partition("=") for part in parts)}
    return located.backend.averages_shard_losses(located.backend.resolve_options(given, str(located.target)))


def resolve_targets(requested: list[str] | None, reference: str = REFERENCE) -> list[str]:
    """The targets to run, the reference first: every available one, or the requested ones with their variants
    kept (``xla:xla-mode=openxla`` -> ``xla-cpu:xla-mode=openxla``)."""
    targets = available_targets(reference)
    if requested:
        targets = [":".join([split_variant(entry)[0], *entry.split(":")[1:]]) for entry in requested]
    seen = list(dict.fromkeys(targets))
    if reference in seen:
        seen.remove(reference)
    return [reference, *seen]     # the baseline of loss parity, first


def child_command(program_ref: str, target: str, options: ChildOptions, devices: int, out: Path,
                  processes: int = 1) -> list[str]:
    located = locate(target.split(":")[0])
    _, variant = split_variant(target)
    cmd = [located.python, "-m", "xbridge", "run", program_ref, "--backend", str(located.target), *variant, "--steps",
           str(options.steps), "--warmup", str(options.warmup), "--devices", str(devices), "--format", "json",
           "--out", str(out)]
    if options.precision:
        cmd += ["--precision", options.precision]
    if options.mesh:
        cmd += ["--mesh", options.mesh]
    for flag, value in (("--rng", options.rng), ("--remat", options.remat), ("--attention", options.attention)):
        if value:
            cmd += [flag, value]
    if options.tensorboard is not None:
        cmd += ["--tensorboard", str(options.tensorboard / target)]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    return cmd + options.extra


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_target(program_ref: str, target: str, options: ChildOptions, out: Path) -> TargetRun:
    """One target in a process of its own (a fresh interpreter, or a warm server's fork where one is set up:
    xbridge/processes/warm.py); a failure, a timeout or a kill becomes the status."""
    backend = locate(target.split(":")[0]).backend
    processes = options.processes if backend.multi_process else 1
    per_process = options.devices * (options.processes // processes)      # one process: every device in it
    devices = per_process * processes if backend.sharded else 1
    cmd = child_command(program_ref, target, options, per_process if backend.sharded else 1, out / target, processes)
    run = TargetRun(target, devices, cmd, "ok")
    env = {**os.environ, "XBRIDGE_DEBUG": "0", **handed_down()}
    try:
        proc = warm.capture(cmd, env, timeout=options.timeout_s)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        run.status, run.error = "timeout", f"no result after {options.timeout_s:g} s\n{_tail(stderr)}"
        return run
    if proc.returncode != 0:
        reason = f"exit code {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
        last = _tail(proc.stderr, 1).removeprefix("error: ")   # the child's one error line, or its exception
        run.status, run.error = "failed", f"{reason}{': ' + last if last else ''}\n{_tail(proc.stderr)}"
        return run
    try:
        run.result = RunRecord.from_json(json.loads(proc.stdout))
    except (json.JSONDecodeError, KeyError, TypeError):
        run.status, run.error = "failed", f"no JSON result on stdout\n{_tail(proc.stderr)}"
    return run
