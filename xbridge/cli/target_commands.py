"""``xbridge compare`` and ``xbridge parity``: every target in its own process (xbridge/run/isolated.py), then the
comparison (xbridge/compare) or the verdicts (xbridge/parity), printed as a table or as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..errors import ConfigError
from ..files import check_writable, claim
from .common_options import (
    ATTENTION,
    FORMAT,
    MESH,
    PROFILE,
    PROGRAM,
    REFERENCE_OPTION,
    REMAT,
    RNG,
    TARGET_DEVICES,
    TARGET_PROCESSES,
    TENSORBOARD,
    TIMEOUT,
    Format,
    emit,
)
from .program_overrides import load_with_overrides


def target_list(backends: str | None) -> list[str] | None:
    if backends is None:
        return None
    targets = [t.strip() for t in backends.split(",") if t.strip()]
    if not targets:
        raise ConfigError("--backends names no target; give some (e.g. --backends jax-cpu,xla-cpu), or leave it out "
                          "for every target available here")
    return targets


def _job(command: str) -> Any:
    """The command's job module (xbridge/compare/job.py or xbridge/parity/job.py), imported when the command runs:
    numpy and the runner stay out of the CLI's start."""
    if command == "compare":
        from ..compare import job as compare_job
        return compare_job
    from ..parity import job as parity_job
    return parity_job


def over_targets(command: str, program_path: str, out: Path, format: Format, **fields: Any) -> None:
    """What compare and parity share: their options (``xbridge.<command>.job.<Command>Options`` from the command's
    fields, targets from --backends), the program with the overrides, --out checked before any work, the job
    (``xbridge.<command>.job.<command>``) with a progress display, the record printed with
    ``tables.print_<command>``, and exit 1 when a target failed (compare) or did not pass (parity)."""
    from . import tables
    from .progress import target_progress

    job = _job(command)
    options = getattr(job, f"{command.capitalize()}Options")(targets=target_list(fields.pop("backends")), **fields)
    prog = load_with_overrides(program_path, options.precision, mesh=options.mesh, rng=options.rng,
                               remat=options.remat, attention=options.attention)
    check_writable(out, "--out", job.OUTPUTS)
    claim(out, "--out")
    with target_progress(enabled=format is Format.human, label=f"{command} {prog.name}") as tick:
        record = getattr(job, command)(program_path, prog, options, out, progress=tick)
    emit(record, format, getattr(tables, f"print_{command}"))
    if not record.passed:
        raise typer.Exit(1)


def compare(
    program: str = PROGRAM,
    backends: str | None = typer.Option(
        None, "--backends", help="Comma-separated targets, each optionally TARGET:OPTION=VALUE to pass a run option "
        "(e.g. xla-cpu:xla-mode=openxla,jax-cpu:sharding-mode=shard_map). Default: every target available here; "
        "the reference (--reference) is always run."),
    steps: int = typer.Option(20, help="Steps per target (warm-up included)."),
    warmup: int | None = typer.Option(None, help="Leading steps excluded from timing (default 3, or steps - 1 when "
                                                 "fewer steps are run)."),
    devices: int = TARGET_DEVICES,
    processes: int = TARGET_PROCESSES,
    precision: str | None = typer.Option(None, help="Override the program's precision."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    mesh: str | None = MESH,
    timeout: float = TIMEOUT,
    reference: str = REFERENCE_OPTION,
    tensorboard: Path | None = TENSORBOARD,
    profile: str | None = PROFILE,
    topology: str | None = typer.Option(None, "--topology", help="Compile the targets of --backends this machine "
                                        "cannot run (jax-tpu) for this TPU slice (e.g. v5e-8) instead: a "
                                        "compile-only row of estimates, apart from the measured ones."),
    recommend: bool = typer.Option(True, "--recommend/--no-recommend", help="After the race, name the fastest "
                                   "target whose losses pass parity against the reference, its speed-up and the "
                                   "xbridge run command for it (in the table, report.md and results.json)."),
    out: Path = typer.Option(Path("out/compare"), help="Directory for results.json, results.csv, the plots and "
                                                       "each run's run.json."),
    format: Format = FORMAT,
) -> None:
    """Run the program on several targets, each in its own process, and compare them side by side."""
    warmup = min(3, steps - 1) if warmup is None else warmup
    if tensorboard is not None:
        check_writable(tensorboard, "--tensorboard")
        from ..run.scalars import check_available

        check_available()
    if profile is not None:
        from ..run.profile import ProfileSpec

        ProfileSpec.parse(profile, steps)
    over_targets("compare", program, out, format, backends=backends, steps=steps, warmup=warmup, devices=devices,
                 precision=precision, mesh=mesh, timeout_s=timeout, reference=reference, rng=rng,
                 remat=remat, attention=attention, tensorboard=tensorboard, profile=profile, processes=processes,
                 topology=topology, recommend=recommend)



def parity(
    program: str = PROGRAM,
    backends: str | None = typer.Option(None, "--backends", help="Comma-separated targets to check, each "
                                                                 "optionally TARGET:OPTION=VALUE (e.g. "
                                                                 "xla-cpu:xla-mode=openxla). Default: every target "
                                                                 "available here."),
    steps: int = typer.Option(20, help="Steps to compare."),
    devices: int = TARGET_DEVICES,
    processes: int = TARGET_PROCESSES,
    precision: str | None = typer.Option(None, help="Override the precision (the reference runs it too; the "
                                                    "fp32 deviation is reported as well)."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    mesh: str | None = MESH,
    bisect: bool = typer.Option(False, "--bisect", help="Also name the first module whose forward output "
                                                        "deviates (hooks on every module, first batch), and the "
                                                        "first, in backward order, whose parameters' gradients "
                                                        "do."),
    timeout: float = TIMEOUT,
    reference: str = REFERENCE_OPTION,
    jobs: int = typer.Option(1, "--jobs", help="Runs at a time, each its own process (parity compares results, "
                                               "not timings; mind the memory of N models)."),
    format: Format = FORMAT,
    out: Path = typer.Option(Path("out/parity"), help="Directory for parity.json, the initial weights and each "
                                                      "target's state."),
) -> None:
    """Check that every target matches the eager reference: same weights, same batches, the tolerance policy."""
    over_targets("parity", program, out, format, backends=backends, steps=steps, devices=devices,
                 precision=precision, mesh=mesh, bisect=bisect, timeout_s=timeout, jobs=jobs,
                 reference=reference, rng=rng, remat=remat, attention=attention, processes=processes)
