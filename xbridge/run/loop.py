"""The run loop, once for every backend: resume, prepare (prepare.py), run the steps (steps.py) with evaluations
and checkpoints between them, and assemble the run record (summary.py).
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__, checkpoint, processes
from ..contract import registry
from ..contract.capabilities import (
    GRADIENT_PREFIX,
    diagnostics,
    multi_process,
    probes,
    sharded,
    traced_gradients,
    traced_modules,
)
from ..data.source import BatchCheck, checked_batch, tokens_per_example
from ..errors import ConfigError, Interrupted, Terminated
from ..files import write_npz
from ..ir.program import Program
from . import scalars
from .evaluation import Evaluator
from .prepare import Prepared, attention_report, prepare, readable
from .profile import ProfileSpec, summarise
from .provenance import provenance
from .record import RunRecord, StepRecord
from .rng import rng_rows
from .steps import Progress, deferred_interrupt, train
from .summary import data_info, machine, peak_rss_bytes, summarize


@dataclass(frozen=True)
class RunOptions:
    """How one run goes, validated when built (the CLI's ``run`` flags, or the Python API's arguments); never
    changed after (a run over several processes gets a copy: ``dataclasses.replace``)."""

    steps: int = 30
    warmup: int | None = None     # default: 2, or steps - 1 when fewer steps are run
    devices: int = 1
    dump: Path | None = None
    state_out: Path | None = None   # write the final state_dict here (.npz, no pickle)
    trace_out: Path | None = None   # write each module's output of a forward pass on batch 0 and each parameter's
                                    # gradient of its loss, before training
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
    processes: int | str = 1               # --processes: a count, or "cluster" (xbridge/processes/)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR (where to write the checkpoints)")
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1, got {self.keep}")
        warmup = min(2, self.steps - 1) if self.warmup is None else self.warmup
        if not 0 <= warmup < self.steps:
            raise ConfigError(f"--warmup must be in [0, steps) = [0, {self.steps}), got {warmup}")
        object.__setattr__(self, "warmup", warmup)     # the default filled in once (the dataclass is frozen)
        if self.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {self.devices}")
        if self.profile is not None:
            ProfileSpec.parse(self.profile, self.steps)
            if self.profile_dir is None:
                raise ConfigError("--profile needs --out DIR (the trace is written under DIR/profile)")


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
    prepared = prepare(program, target_text, options, weights)
    try:
        return _run_prepared(program, prepared, options, progress, resumed, writer, board)
    finally:
        prepared.executable.close()


def _run_prepared(program: Program, prepared: Prepared, options: RunOptions, progress: Progress | None,
                  resumed: checkpoint.Checkpoint | None, writer: checkpoint.Writer | None,
                  board: scalars.Scalars | None) -> RunRecord:
    start = resumed.step if resumed else 0
    from ..torch.seeding import seed_host

    seed_host(program.seed)     # numpy's and Python's generators, for a forward or data source that draws from them
    if writer is not None and processes.this_process()[0] == 0:    # process 0 commits every process's checkpoint
        writer.lock()
    target, backend, plan, executable = prepared.target, prepared.backend, prepared.plan, prepared.executable
    if resumed is not None:
        executable.load_training_state(readable(executable, resumed.train))
    if options.trace_out is not None:
        # the training batch as the step sees it (with --rng portable, its rows for the generator: the traced
        # forward draws what the step draws)
        check = BatchCheck(program.data, expected_rows=program.data.batch_size, rng_rows=rng_rows(program))
        probed = check(program.data.batch(start, program.seed), start)
        outputs = traced_modules(executable, probed)
        grads = traced_gradients(executable, probed) or {}
        write_npz(options.trace_out, {**outputs, **{GRADIENT_PREFIX + name: value for name, value in grads.items()}})
    versions = {"xbridge": __version__, "numpy": np.__version__, **backend.versions()}
    assert options.warmup is not None   # RunOptions fills in the default
    warmup = min(options.warmup, options.steps - start - 1)
    saved: list[str] = []

    def save(done: int) -> None:
        assert writer is not None
        info = checkpoint.manifest_info(program, str(target), options.devices, dict(plan.mesh), done, versions)
        pieces = split.piece_writer() if (split := sharded(executable)) is not None else None
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
            signum = interrupt["signal"]
            if processes.this_process()[1] > 1 and (job := multi_process(executable)) is not None:
                # the processes saw the signal at different points (or one alone got it): all stop here, and
                # SIGTERM (15) wins over Ctrl-C (2), so the job ends as a terminated one that a restart resumes
                signum = interrupt["signal"] = int(job.gathered(np.asarray([signum], np.int64)).max())
            due = options.checkpoint_every is not None and done % options.checkpoint_every == 0
            if due or done == options.steps or signum:
                save(done)
            if signum and done < options.steps:
                error, what = (Terminated, "terminated by SIGTERM") if signum == signal.SIGTERM else \
                    (Interrupted, "interrupted")
                raise error(f"{what} after step {done} of {options.steps}; checkpoint {saved[-1]} written "
                            f"(continue with --resume {options.checkpoint_dir})")

        spec = ProfileSpec.parse(options.profile, options.steps) if options.profile else None
        if spec is not None and spec.stop <= start:
            raise ConfigError(f"--profile {spec}: the run resumes at step {start}, after the profiled steps")
        traced = (spec, options.profile_dir) if spec is not None and options.profile_dir is not None else None
        rss_before_steps = peak_rss_bytes()
        records = train(program, prepared, options.steps, warmup, progress, start, after_step,
                        lambda: writer.last if writer else None, options.prefetch, traced)
    summary = summarize(program, records, warmup)
    # a restarted job: the steps before its checkpoint, logged once
    earlier = [StepRecord.from_json(step) for step in processes.earlier_steps(start)]
    if earlier:
        records = earlier + records
        summary.first_loss = records[0].loss     # the timings stay this attempt's
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
        versions=versions, machine=machine(), start_step=records[0].step if records else start,
        resumed_from=str(resumed.path) if resumed else None,
        config_changes=checkpoint.config_changes(resumed.manifest, program) if resumed else [],
        checkpoints=saved, steps=records, summary=summary, dumped=dumped,
        device_kind=diag.device_kind() or target.device, device_peak_bytes=diag.device_peak_bytes(),
        peak_host_rss_bytes=peak_rss_bytes(), host_rss_before_steps_bytes=rss_before_steps,
        layout=diag.layout(),
        compile_cache=cache.to_json() if (cache := diag.compile_cache()) is not None else None,
        data=data_info(program), evals=evaluator.records if evaluator else [], provenance=provenance(program),
        profile=summarise(traced[1], traced[0]) if traced else None,
        processes=options.processes if isinstance(options.processes, int) else 1, restarts=processes.restarts())
