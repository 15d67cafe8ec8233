"""Everything before the first step, once for every backend: resolve the target, plan, check the loss, lower, load
the initial weights and check a forced attention kernel; and what the run record says of the attention calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import processes
from ..contract import Backend, Executable, Target, registry
from ..contract.capabilities import multi_process, probes, reads_slices
from ..contract.checks import StepChecks
from ..data.source import checked_batch
from ..errors import BackendUnavailable, ConfigError, ProgramError
from ..ir.program import Program
from ..planner import ShardingPlan
from ..planner import plan as make_plan
from .rng import with_rng

if TYPE_CHECKING:
    from ..torch.op_census import Census
    from .loop import RunOptions


@dataclass
class Prepared:
    target: Target
    backend: Backend
    plan: ShardingPlan
    executable: Executable
    options: dict[str, str]      # the backend's options, defaults filled in
    attention_calls: int | None = None   # the forward's attention calls on the meta device (None: not known)


def check_weights(program: Program, weights: dict[str, np.ndarray]) -> None:
    """Weights handed in from outside (``--init-state``) must be this program's state: same names, same shapes."""
    from ..torch.weights import shape_mismatch

    problem = shape_mismatch(program, weights, "the --init-state file")
    if problem is not None:
        raise ConfigError(problem)


def prepare(program: Program, target_text: str, options: RunOptions,
            weights: dict[str, np.ndarray] | None = None) -> Prepared:
    """Resolve the target, plan, lower and load the initial weights: everything before the first step."""
    target, backend = registry.resolve(target_text)
    available = backend.device_count(target.device)
    if available is not None and options.devices > available:
        raise BackendUnavailable(f"target {target} has {available} device(s) here, but --devices {options.devices} "
                                 "was asked for")
    backend_options = backend.resolve_options(options.backend_options, str(target))
    # An unsharded backend runs the program on one device: same axis names, every axis of size 1.
    planned = program if backend.sharded else program.replace(mesh=program.mesh.collapsed())
    plan = make_plan(planned, options.devices)
    from .. import forked
    from ..check.before_run import checked_step, refuse_what_fails

    # before any compile, in a forked copy of this process: the loss is then called once per step (forked.py)
    nothing: tuple[int | None, Census | None] = (None, None)
    calls, found = forked.call(checked_step, program, isinstance(backend, StepChecks), fallback=nothing)
    backend.configure(target.device, options.devices, options.dump)
    # after configure: a stack's tables may load the framework (torch_xla reads its settings once, when it loads)
    refuse_what_fails(program, target, backend, backend_options, found)
    executable = backend.lower(with_rng(program), plan, target, backend_options)
    if weights is None:
        from ..torch.weights import initial_weights  # the reference builds the weights once

        weights = initial_weights(program)
        check_replicas(executable, weights)
    else:
        check_weights(program, weights)
        weights = readable(executable, weights)
    executable.init(weights)
    if program.step.attention != "auto":
        check_attention(program, target, executable)
    return Prepared(target, backend, plan, executable, backend_options, calls)


def check_replicas(executable: Executable, weights: dict[str, np.ndarray]) -> None:
    """Several processes each build the initial weights: they must be the same everywhere (a replicated parameter
    is one value). xbridge seeds torch's, numpy's and Python's generators before the builder runs; a builder that
    draws from anything else (the time, the process id, its own unseeded generator) builds other weights in each
    process, and training would go on with replicas that disagree. One line naming the first such parameter."""
    job = multi_process(executable)
    if processes.this_process()[1] == 1 or job is None:
        return
    import hashlib

    digests = np.stack([np.frombuffer(hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=8).digest(),
                                      dtype=np.int32) for array in weights.values()])
    every = job.gathered(digests)
    names = list(weights)
    for index in range(1, len(every)):
        differs = np.flatnonzero((every[index] != every[0]).any(axis=1))
        if len(differs):
            raise ProgramError(f"the model builder gave process {index} other initial weights than process 0, first "
                               f"in {names[differs[0]]!r}: it draws from something xbridge does not seed (torch's, "
                               "numpy's and Python's global generators are seeded from the program's seed); build "
                               "from those, or from the seed, so that every replica starts the same")


def readable(executable: Executable, arrays: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's tensors as they are (the executable reads the slices it needs) or read whole."""
    return arrays if reads_slices(executable) else {name: np.asarray(value) for name, value in arrays.items()}


def check_attention(program: Program, target: Target, executable: Executable) -> None:
    """A forced attention kernel runs on the first batch before the first step, or the run stops with one line."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:      # torch says why a kernel was not used, as warnings
        warnings.simplefilter("always")
        try:
            if (probe := probes(executable)) is not None:
                probe.attention_kernels(checked_batch(program.data, 0, program.seed))
        except RuntimeError as exc:
            if "No available kernel" not in str(exc) and "No viable backend" not in str(exc):
                raise
            reasons = dict.fromkeys(str(w.message).split(" (Triggered internally")[0].strip() for w in caught)
            said = f": {' '.join(reasons)}" if reasons else ""
            raise ConfigError(f"StepOptions attention={program.step.attention!r} cannot run on {target} for the "
                              f"attention calls of program {program.name!r}{said}; use attention='auto'") from None



def attention_report(program: Program, prepared: Prepared, start: int) -> dict[str, int] | None:
    """The run record's ``summary.attention``: ``{}`` for a model the meta check saw call no attention, else the
    backend's probe; None when it cannot tell (a probe that fails does not fail a finished run)."""
    if prepared.attention_calls == 0:
        return {}
    if (probe := probes(prepared.executable)) is None:
        return None
    try:
        return probe.attention_kernels(checked_batch(program.data, start, program.seed))
    except Exception:
        return None
