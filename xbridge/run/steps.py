"""The step loop, once for every backend: feed the batches, time each step, stop on a non-finite loss, and let
the first Ctrl-C or SIGTERM of a checkpointing run finish its step and write a checkpoint.

A step's time is wall time from handing the batch to the executable until its metrics are back on the host (the
executable synchronises its device before returning the loss). The first ``warmup`` steps, which include tracing
and compilation, are reported separately and excluded from the steady-state statistics.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import processes
from ..contract import Executable
from ..contract.capabilities import diagnostics, profiling
from ..data.source import BatchCheck
from ..errors import ProgramError, RunError, TermSignal
from ..ir.program import Program
from .feed import Feed
from .prepare import Prepared
from .profile import ProfileSpec
from .record import StepRecord
from .rng import rng_rows

Progress = Callable[[int, StepRecord], None]


@contextlib.contextmanager
def deferred_interrupt(enabled: bool) -> Any:
    """While checkpointing, the first Ctrl-C or SIGTERM lets the current step finish and asks for a final
    checkpoint (the yielded dict's ``signal``: the signal's number, 0 while none came); a second one aborts at once."""
    state = {"signal": 0}
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum: int, frame: Any) -> None:
        if state["signal"]:
            raise TermSignal() if signum == signal.SIGTERM else KeyboardInterrupt
        state["signal"] = int(signum)
        what = "SIGTERM" if signum == signal.SIGTERM else "interrupt"
        print(f"\n{what}: finishing this step, then writing a checkpoint (a second one aborts)", file=sys.stderr)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


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
            processes.log_step(record)      # --max-restarts: the supervisor's log of finished steps
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
    metrics = dict(executable.step(batch))
    processes.beat(f"finished step {step}")
    count = metrics.pop("count", None)      # xb.LossSum's count over the step's whole batch
    if count is not None and count == 0:
        raise ProgramError(f"step {step}: the loss's xb.LossSum count is 0 over the whole batch: no item to take "
                           "the loss over (it would train on nothing); feed batches that hold some")
    if count is not None and count < 0:
        raise ProgramError(f"step {step}: the loss's xb.LossSum count is negative over the whole batch; the count is "
                           "how many items (or their total weight) the total sums, never below 0")
    elapsed = time.perf_counter() - start_time
    read = check.bytes_read.pop(step, None)     # None: the backend's processes read their rows themselves
    extra = {"data_wait_s": waited, **({"data_bytes": float(read)} if read is not None else {}),
             **{k: float(v) for k, v in metrics.items() if k != "loss"}}
    return StepRecord(step, float(metrics["loss"]), elapsed, extra)


def nonfinite_message(prepared: Prepared, loss: float, step: int, last_good: Path | None) -> str:
    culprits = diagnostics(prepared.executable).nonfinite_grads()
    if culprits:
        grads = f"first non-finite gradient: {culprits[0]!r} ({len(culprits)} parameter(s) in all)"
    else:
        grads = "every parameter gradient is finite" if culprits is not None else "gradients not inspected"
    kept = f"; the last good checkpoint is {last_good}" if last_good else ""
    return (f"loss became {loss} at step {step} on {prepared.target}; {grads}{kept}; lower the learning rate "
            "or use a wider precision")
