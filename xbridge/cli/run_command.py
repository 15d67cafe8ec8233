"""``xbridge run``: one program on one target, its per-step loss and step time, run.json; with --processes, the
processes it starts (each running this same command line)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from ..errors import ConfigError
from ..files import check_file_writable, check_writable, claim, read_npz, write_json
from .backend_flags import parse_backend_flags
from .common_options import ATTENTION, MESH, PROCESSES, PROFILE, REMAT, RNG, TENSORBOARD, Format
from .program_overrides import load_with_overrides

COMMAND_LINE: list[str] = []    # the command line main() was given: --processes starts its processes with it


def run(
    ctx: typer.Context,
    program: str = typer.Argument(..., help="Program file (defines `program = xb.Program(...)`), or FILE.py:NAME."),
    backend: str = typer.Option("eager", "--backend", "-b", help="Target BACKEND-DEVICE (e.g. eager-cpu, "
                                                                 "jax-tpu) or a bare backend name."),
    steps: int = typer.Option(30, help="Optimizer steps to run (warm-up included)."),
    warmup: int | None = typer.Option(None, help="Leading steps excluded from timing, where tracing and "
                                                 "compilation happen (default 2)."),
    seed: int | None = typer.Option(None, help="Override the program's seed (initial weights and batches)."),
    precision: str | None = typer.Option(None, help="Override the precision: fp32, bf16-mixed, bf16-true, "
                                                    "fp16-mixed or params=...,compute=...,output=..."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    devices: int = typer.Option(1, help="Devices the mesh spans (with --processes: devices per process)."),
    mesh: str | None = MESH,
    processes: str | None = PROCESSES,
    max_restarts: int = typer.Option(0, "--max-restarts", help="When the run fails (a process of --processes P, an "
                                                               "inductor rank, the run itself), start it again, "
                                                               "every process, from the newest checkpoint in "
                                                               "--checkpoint-dir, at most N times (under torchrun: "
                                                               "torchrun --max-restarts)."),
    out: Path | None = typer.Option(None, help="Directory to write run.json into."),
    dump: Path | None = typer.Option(None, help="Directory to write what the backend compiled (graphs, HLO)."),
    save_state: Path | None = typer.Option(None, help="Write the final parameters and buffers (eager names) to "
                                                      "this .npz file."),
    init_state: Path | None = typer.Option(None, help="Start from these weights (.npz under the eager names) "
                                                      "instead of building them from the seed."),
    trace_modules: Path | None = typer.Option(None, help="Before training, write every module's output on batch "
                                                         "0, and each parameter's gradient of its loss (keys "
                                                         "'grad:NAME'), to this .npz (for parity --bisect)."),
    checkpoint_dir: Path | None = typer.Option(None, help="Write checkpoints here: at the end, every "
                                                          "--checkpoint-every steps and on Ctrl-C."),
    checkpoint_every: int | None = typer.Option(None, help="Save a checkpoint every N steps (needs --checkpoint-dir)."),
    keep: int | None = typer.Option(None, help="Newest checkpoints kept in --checkpoint-dir (default 3)."),
    resume: Path | None = typer.Option(None, help="Continue from a checkpoint (a step-NNNNNNNN directory, or a "
                                                  "checkpoint directory: its newest); --steps stays the total."),
    allow_config_change: bool = typer.Option(False, "--allow-config-change", help="Resume a checkpoint written "
                                                                                  "by another program config "
                                                                                  "(shapes must still match)."),
    prefetch: bool = typer.Option(True, "--prefetch/--no-prefetch", help="Load the next batch while the current "
                                                                         "step runs (docs/data.md)."),
    tensorboard: Path | None = TENSORBOARD,
    profile: str | None = PROFILE,
    matmul_dtypes: bool = typer.Option(False, "--matmul-dtypes", help="After the run, count the matrix products of "
                                                                      "one forward pass by the dtype they compute in "
                                                                      "(docs/parity.md)."),
    format: Format = typer.Option(Format.human, "--format", help="human: progress bar and table; json: one JSON "
                                                                 "document on stdout."),
) -> None:
    """Run a program on one target and report per-step loss and step time. Backend options (e.g. --sharding-mode)
    are listed at the end of this help."""
    from .. import processes as job
    from ..run.loop import RunOptions
    from .environment_command import run_elsewhere

    run_elsewhere(COMMAND_LINE, backend)     # a target only another environment runs runs there (same command)
    from ..run.loop import run as run_program
    from .progress import progress_bar
    from .tables import print_run

    backend_options = parse_backend_flags(ctx)
    spread = job.parse(processes)
    if spread != 1:
        from ..contract import registry

        job.joining()       # before the target is resolved: a jax accelerator probe would start the runtime
        try:
            target, chosen = registry.resolve(backend)
            if not chosen.multi_process:
                chosen.join_processes(target.device, devices, spread)      # the backend's own refusal
        except BaseException:
            job.joining(False)
            raise
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts and (spread == job.CLUSTER or job.under_torchrun()):
        launcher = "torchrun" if job.under_torchrun() else "the cluster's launcher"
        raise ConfigError(f"--max-restarts restarts the processes xbridge starts here; {launcher} started this one: "
                          "its own restarts apply (torchrun --max-restarts; docs/multi-process.md)")
    restarted_from = job.torchrun_resume(checkpoint_dir)
    if restarted_from is not None:    # torchrun restarted the job: every rank resumes from the newest checkpoint
        resume, init_state, profile = restarted_from, None, None
    if job.torchrun_restarts() and os.environ.get("RANK") == "0":
        print(f"xbridge: torchrun restarted the job ({job.torchrun_restarts()} time(s)); every rank resumes from "
              + (f"checkpoint {restarted_from}" if restarted_from is not None
                 else f"{resume} (no checkpoint of --checkpoint-dir yet)" if resume is not None
                 else "step 0 (no checkpoint yet)"), file=sys.stderr)
    if keep is not None and checkpoint_dir is None:
        raise ConfigError("--keep needs --checkpoint-dir DIR (the checkpoints it keeps are written there)")
    if allow_config_change and resume is None:
        raise ConfigError("--allow-config-change needs --resume CHECKPOINT (it lets a resume take a checkpoint of "
                          "another program config)")
    options = RunOptions(steps=steps, warmup=warmup, devices=devices, dump=dump, state_out=save_state,
                         trace_out=trace_modules, backend_options=backend_options, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, keep=3 if keep is None else keep, resume=resume,
                         allow_config_change=allow_config_change, prefetch=prefetch, matmul_dtypes=matmul_dtypes,
                         tensorboard=tensorboard, profile=profile,
                         profile_dir=out / "profile" if out is not None and profile is not None else None,
                         processes=spread)
    prog = load_with_overrides(program, precision, seed, mesh, rng, remat, attention)
    weights = read_npz(init_state, "--init-state") if init_state is not None else None
    if out is not None:
        check_writable(out, "--out", ("run.json",))
        if job.CHILD not in os.environ and (job.environment_job() or (0, 1))[0] == 0 \
                and os.environ.get("RANK", "0") == "0":     # the command's own process, not one its job started
            claim(out, "--out")
    if dump is not None:
        check_writable(dump, "--dump")
    if tensorboard is not None:
        check_writable(tensorboard, "--tensorboard")
    for path, flag in ((save_state, "--save-state"), (trace_modules, "--trace-modules")):
        if path is not None:
            check_file_writable(path, flag)
    if job.must_start(spread) or (max_restarts and job.CHILD not in os.environ):
        # checked above; now the processes, each running this same command (one, to be restarted, without P)
        raise typer.Exit(job.start(spread if isinstance(spread, int) else 1, COMMAND_LINE, max_restarts,
                                   checkpoint_dir, steps))
    job.torchrun_attempt(checkpoint_dir, restarted_from)
    from ..data.source import tokens_per_example

    tokens = prog.data.batch_size * tokens_per_example(prog.data)
    lead = (job.environment_job() or (0, 1))[0] == 0       # process 0 shows the progress
    with progress_bar(enabled=format is Format.human and lead, total=steps, label=f"{prog.name} on {backend}",
                      tokens_per_step=tokens) as tick:
        result = run_program(prog, backend, options, progress=tick, weights=weights)
    if job.this_process()[0] > 0:        # the report and run.json are process 0's
        return
    if out is not None:
        result.written = str(out / "run.json")
        write_json(out / "run.json", result.to_json())
    if format is Format.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_run(result)
