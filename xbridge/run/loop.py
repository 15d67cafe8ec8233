"""The run loop, once for every backend: lower, load the initial weights, warm up, time steps, summarise.

A step's time is wall time from handing the batch to the executable until its metrics are back on the host (the
executable synchronises its device before returning the loss). The first ``warmup`` steps, which include tracing
and compilation, are reported separately and excluded from the steady-state statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..contract import Backend, Executable, MultiProcess, ShardedCheckpoint, Target, registry
from ..contract.capabilities import diagnostics, probes, profiling, reads_slices, traced_modules
from ..data.contract import BatchCheck, checked_batch, describe, reproducible, tokens_per_example
from ..errors import BackendUnavailable, ConfigError, Interrupted, RunError
from ..files import write_npz
from ..ir.program import Program
from ..planner import ShardingPlan
from ..planner import plan as make_plan
from . import checkpoint, processes, scalars
from .evaluation import Evaluator
from .feed import Feed
from .profile import ProfileSpec, summarise
from .provenance import provenance
from .record import RunRecord, RunSummary, StepRecord
from .rng import rng_rows, with_rng

Progress = Callable[[int, StepRecord], None]


@dataclass
class RunOptions:
    steps: int = 30
    warmup: int | None = None     # default: 2, or steps - 1 when fewer steps are run
    devices: int = 1
    dump: Path | None = None
    state_out: Path | None = None   # write the final state_dict here (.npz, no pickle)
    trace_out: Path | None = None   # write each module's output of a forward pass on batch 0, before training
    backend_options: dict[str, str] = field(default_factory=dict)   # checked against the backend's declared options
    checkpoint_dir: Path | None = None     # save checkpoints here (at the end, every checkpoint_every, on Ctrl-C)
    checkpoint_every: int | None = None
    keep: int = 3                          # newest checkpoints kept in checkpoint_dir
    resume: Path | None = None             # a checkpoint, or a directory whose newest checkpoint is resumed
    allow_config_change: bool = False      # resume a checkpoint written by another program config
    prefetch: bool = True                  # read and place the next batch while the current step runs
    matmul_dtypes: bool = False            # count the forward's matrix products by dtype after the run
    tensorboard: Path | None = None        # write each step's scalars as TensorBoard event files here
    profile: str | None = None             # --profile steps=A:B: trace those steps with the backend's profiler
    profile_dir: Path | None = None        # where the trace goes (run: OUT/profile)
    processes: int | str = 1               # --processes: a count, or "cluster" (xbridge/run/processes.py)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR (where to write the checkpoints)")
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1, got {self.keep}")
        if self.warmup is None:
            self.warmup = min(2, self.steps - 1)
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(f"--warmup must be in [0, steps) = [0, {self.steps}), got {self.warmup}")
        if self.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {self.devices}")
        if self.profile is not None:
            ProfileSpec.parse(self.profile, self.steps)
            if self.profile_dir is None:
                raise ConfigError("--profile needs --out DIR (the trace is written under DIR/profile)")


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (``platform.processor()`` is empty there), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None


def summarize(program: Program, records: list[StepRecord], warmup: int) -> RunSummary:
    timed = np.array([r.time_s for r in records[warmup:]], dtype=np.float64)
    median = float(np.median(timed))
    batch = program.data.batch_size
    return RunSummary(
        compile_s=records[0].time_s, warmup_steps=warmup, timed_steps=int(timed.size),
        step_time_median_s=median, step_time_p10_s=float(np.percentile(timed, 10)),
        step_time_p90_s=float(np.percentile(timed, 90)), samples_per_s=batch / median,
        tokens_per_s=batch * tokens_per_example(program.data) / median,
        first_loss=records[0].loss, final_loss=records[-1].loss)


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
    from ..weights import shape_mismatch

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
    from ..torch.loss_check import check_loss

    calls = check_loss(program)   # before any compile
    backend.configure(target.device, options.devices, options.dump)
    executable = backend.lower(with_rng(program), plan, target, backend_options)
    if weights is None:
        from ..weights import initial_weights  # the reference builds the weights once

        weights = initial_weights(program)
    else:
        check_weights(program, weights)
        weights = readable(executable, weights)
    executable.init(weights)
    if program.step.attention != "auto":
        check_attention(program, target, executable)
    return Prepared(target, backend, plan, executable, backend_options, calls)


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


@contextlib.contextmanager
def deferred_interrupt(enabled: bool) -> Any:
    """While checkpointing, the first Ctrl-C lets the current step finish and asks for a final checkpoint (the
    yielded dict's ``requested``); a second one aborts at once."""
    state = {"requested": False}
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum: int, frame: Any) -> None:
        if state["requested"]:
            raise KeyboardInterrupt
        state["requested"] = True
        print("\ninterrupt: finishing this step, then writing a checkpoint (Ctrl-C again aborts)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


def train(program: Program, prepared: Prepared, steps: int, warmup: int, progress: Progress | None = None,
          start: int = 0, after_step: Callable[[int], None] | None = None,
          last_good: Callable[[], Path | None] = lambda: None, prefetch: bool = True,
          profile: tuple[ProfileSpec, Path] | None = None) -> list[StepRecord]:
    """Run steps ``start..steps-1`` on the batches of the program's data source; time each one (the wait for a
    batch not yet ready included, as ``data_wait_s``). Warm-up ends ``warmup`` steps after ``start``.
    ``after_step(done)`` runs after each step (done = completed steps). ``profile``: the steps traced by the
    backend's profiler, and where the trace goes."""
    executable = prepared.executable
    records: list[StepRecord] = []
    check = BatchCheck(program.data, expected_rows=program.data.batch_size, rng_rows=rng_rows(program))
    tracing = contextlib.ExitStack()
    with tracing, Feed(lambda s: executable.fetch(program.data, s, program.seed, check), steps, prefetch) as feed:
        for step in range(start, steps):
            if step - start == warmup:
                diagnostics(executable).mark_warm()
            if profile is not None and step == max(profile[0].start, start):
                tracing.enter_context(profiling(executable).profiler(profile[1]))
            profiled = profile is not None and profile[0].start <= step < profile[0].stop
            with profiling(executable).profile_step(step) if profiled else contextlib.nullcontext():
                record = _one_step(executable, feed, step, check)
            if profile is not None and step == profile[0].stop - 1:
                tracing.close()         # the trace is written here, before the steps after it
            if not math.isfinite(record.loss):
                raise RunError(nonfinite_message(prepared, record.loss, step, last_good()))
            records.append(record)
            if progress is not None:
                progress(step, record)
            if after_step is not None:
                after_step(step + 1)
    return records


def _one_step(executable: Executable, feed: Feed, step: int, check: BatchCheck) -> StepRecord:
    start_time = time.perf_counter()
    processes.beat(f"waiting for batch {step}")
    batch, waited = feed.get(step)
    processes.beat(f"in step {step}")
    metrics = executable.step(batch)
    processes.beat(f"finished step {step}")
    elapsed = time.perf_counter() - start_time
    read = check.bytes_read.pop(step, None)     # None: the backend's processes read their rows themselves
    extra = {"data_wait_s": waited, **({"data_bytes": float(read)} if read is not None else {}),
             **{k: float(v) for k, v in metrics.items() if k != "loss"}}
    return StepRecord(step, float(metrics["loss"]), elapsed, extra)


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


def nonfinite_message(prepared: Prepared, loss: float, step: int, last_good: Path | None) -> str:
    culprits = diagnostics(prepared.executable).nonfinite_grads()
    if culprits:
        grads = f"first non-finite gradient: {culprits[0]!r} ({len(culprits)} parameter(s) in all)"
    else:
        grads = "every parameter gradient is finite" if culprits is not None else "gradients not inspected"
    kept = f"; the last good checkpoint is {last_good}" if last_good else ""
    return (f"loss became {loss} at step {step} on {prepared.target}; {grads}{kept}; lower the learning rate "
            "or use a wider precision")


def run(program: Program, target_text: str, options: RunOptions, progress: Progress | None = None,
        weights: dict[str, np.ndarray] | None = None) -> RunRecord:
    """Run ``program`` on ``target_text`` and return the result record (``run.json`` holds its JSON form). With
    ``options.processes``, this process joins the job first; ``options.devices`` is then per process."""
    if options.processes == 1:
        return _run_here(program, target_text, options, progress, weights)
    target, backend = registry.resolve(target_text)
    index, count = backend.join_processes(target.device, options.devices, options.processes)
    options = dataclasses.replace(options, devices=options.devices * count, processes=count)
    processes.joined(index, count)
    if index == 0:
        return _run_here(program, target_text, options, progress, weights)
    scratch = Path(tempfile.mkdtemp(prefix=f"xbridge-process{index}-"))
    try:
        return _run_here(program, target_text, processes.follower_outputs(options, scratch), None, weights)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_here(program: Program, target_text: str, options: RunOptions, progress: Progress | None = None,
              weights: dict[str, np.ndarray] | None = None) -> RunRecord:
    resumed = None
    if options.resume is not None:
        if weights is not None:
            raise ConfigError("--resume and --init-state both give the starting weights; pass one of them")
        resumed = checkpoint.load(checkpoint.locate(options.resume), program, options.allow_config_change)
        weights = resumed.weights
    start = resumed.step if resumed else 0
    if start >= options.steps:
        assert resumed is not None   # steps >= 1: only a resumed run starts past the end
        raise ConfigError(f"checkpoint {resumed.path} is at step {start} and --steps {options.steps} is the total "
                          f"to reach; nothing is left to run (e.g. --steps {start + options.steps})")
    if options.tensorboard is not None:
        scalars.check_available()
    writer = checkpoint.Writer(options.checkpoint_dir, options.keep, start) if options.checkpoint_dir else None
    board = (scalars.Scalars(options.tensorboard, program.data.batch_size * tokens_per_example(program.data))
             if options.tensorboard is not None else None)
    if board is not None:
        def progress_and_board(step: int, record: StepRecord) -> None:
            board.step(record)
            if shown is not None:
                shown(step, record)

        shown, progress = progress, progress_and_board
    try:
        return _run(program, target_text, options, progress, weights, resumed, writer, board)
    finally:
        if writer is not None:
            writer.release()      # the checkpoint directory's lock: another run (in this process too) may write
        if board is not None:
            board.close()


def _run(program: Program, target_text: str, options: RunOptions, progress: Progress | None,
         weights: dict[str, np.ndarray] | None, resumed: checkpoint.Checkpoint | None,
         writer: checkpoint.Writer | None, board: scalars.Scalars | None = None) -> RunRecord:
    start = resumed.step if resumed else 0
    prepared = prepare(program, target_text, options, weights)
    if writer is not None and processes.this_process()[0] == 0:    # process 0 commits every process's checkpoint
        writer.lock()
    target, backend, plan, executable = prepared.target, prepared.backend, prepared.plan, prepared.executable
    if resumed is not None:
        executable.load_training_state(readable(executable, resumed.train))
    if options.trace_out is not None:
        # the training batch as the step sees it (with --rng portable, its rows for the generator: the traced
        # forward draws what the step draws)
        check = BatchCheck(program.data, expected_rows=program.data.batch_size, rng_rows=rng_rows(program))
        write_npz(options.trace_out, traced_modules(executable, check(program.data.batch(start, program.seed), start)))
    versions = {"xbridge": __version__, "numpy": np.__version__, **backend.versions()}
    assert options.warmup is not None   # RunOptions fills in the default
    warmup = min(options.warmup, options.steps - start - 1)
    saved: list[str] = []

    def save(done: int) -> None:
        assert writer is not None
        info = checkpoint.manifest_info(program, str(target), options.devices, dict(plan.mesh), done, versions)
        pieces = executable.piece_writer() if isinstance(executable, ShardedCheckpoint) else None
        if pieces is not None:
            saved.append(str(writer.save_pieces(done, pieces, info)))
        else:
            saved.append(str(writer.save(done, executable.state_dict(), executable.training_state(), info)))

    evaluator = Evaluator(program.eval, program.seed, executable, options.steps) if program.eval else None
    if evaluator is not None:
        evaluator(start)        # the weights we start from; also compiles the eval step before warm-up ends
        if board is not None:
            board.eval(evaluator.records[-1])

    with deferred_interrupt(writer is not None) as interrupt:
        def after_step(done: int) -> None:
            if evaluator is not None and evaluator.due(done):
                evaluator(done)
                if board is not None:
                    board.eval(evaluator.records[-1])
            if writer is None:
                return
            requested = interrupt["requested"]
            if processes.this_process()[1] > 1 and isinstance(executable, MultiProcess):
                # the processes saw Ctrl-C at different points: all stop here
                requested = interrupt["requested"] = executable.any_process(requested)
            due = options.checkpoint_every is not None and done % options.checkpoint_every == 0
            if due or done == options.steps or requested:
                save(done)
            if requested and done < options.steps:
                raise Interrupted(f"interrupted after step {done} of {options.steps}; checkpoint {saved[-1]} "
                                  f"written (continue with --resume {options.checkpoint_dir})")

        spec = ProfileSpec.parse(options.profile, options.steps) if options.profile else None
        if spec is not None and spec.stop <= start:
            raise ConfigError(f"--profile {spec}: the run resumes at step {start}, after the profiled steps")
        traced = (spec, options.profile_dir) if spec is not None and options.profile_dir is not None else None
        rss_before_steps = _peak_rss_bytes()
        records = train(program, prepared, options.steps, warmup, progress, start, after_step,
                        lambda: writer.last if writer else None, options.prefetch, traced)
    summary = summarize(program, records, warmup)
    diag, probe = diagnostics(executable), probes(executable)
    summary.recompiles_after_warmup = diag.recompiles() if warmup else None
    if summary.recompiles_after_warmup:
        summary.recompile_reasons = diag.recompile_reasons()
    if options.matmul_dtypes and probe is not None:
        summary.matmul_dtypes = probe.matmul_dtypes(checked_batch(program.data, start, program.seed))
    summary.attention = attention_report(program, prepared, start)
    dumped = [str(p) for p in diag.dump(options.dump)] if options.dump else []
    if options.state_out is not None:
        write_npz(options.state_out, executable.state_dict())
    return RunRecord(
        xbridge=__version__, program=program.name, config=program.config(), config_hash=program.config_hash,
        target=str(target), backend_options=prepared.options, precision=program.precision.name, rng=program.step.rng,
        devices=options.devices, mesh=dict(plan.mesh), param_bytes_per_device=plan.bytes_per_device,
        versions=versions, machine=machine(), start_step=start,
        resumed_from=str(resumed.path) if resumed else None,
        config_changes=checkpoint.config_changes(resumed.manifest, program) if resumed else [],
        checkpoints=saved, steps=records, summary=summary, dumped=dumped,
        device_kind=diag.device_kind() or target.device, device_peak_bytes=diag.device_peak_bytes(),
        peak_host_rss_bytes=_peak_rss_bytes(), host_rss_before_steps_bytes=rss_before_steps,
        layout=diag.layout(),
        compile_cache=cache.to_json() if (cache := diag.compile_cache()) is not None else None,
        data=data_info(program), evals=evaluator.records if evaluator else [], provenance=provenance(program),
        profile=summarise(traced[1], traced[0]) if traced else None,
        processes=options.processes if isinstance(options.processes, int) else 1)


def data_info(program: Program) -> dict[str, Any]:
    """The run record's ``data``: each source's description, and whether the config alone identifies the data."""
    sources = {"train": describe(program.data)}
    if program.eval is not None:
        sources["eval"] = describe(program.eval.data)
    return {**sources, "reproducible": all(reproducible(d) for d in sources.values())}


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
