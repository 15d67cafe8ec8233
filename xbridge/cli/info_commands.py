"""The commands that describe without training: ``cache`` (the compilation caches), ``backends`` (the targets) and
``inspect`` (a program's parameters, FLOPs, sharding plan and memory)."""

from __future__ import annotations

import dataclasses

import typer

from ..errors import ConfigError
from .common_options import FORMAT, MESH, PROGRAM, REMAT, RNG, Format, emit
from .program_overrides import load_with_overrides


def cache(
    names: list[str] = typer.Argument(None, help="With --clear: the caches to empty (default: all).",
                                      show_default=False),
    clear: bool = typer.Option(False, "--clear", help="Empty the caches (the next run of each backend compiles "
                                                      "from scratch)."),
    format: Format = FORMAT,
) -> None:
    """Where the compilation caches are and how big they are; --clear empties them."""
    from .. import cache as caches
    from .tables import print_caches

    if names and not clear:
        raise ConfigError("cache names are for --clear (xbridge cache --clear inductor); `xbridge cache` lists them")
    removed = caches.clear(list(names or [])) if clear else None
    rows = [dataclasses.asdict(info) for info in (removed if removed is not None else caches.describe())]
    record = {"root": str(caches.cache_root()), "cleared": clear, "caches": rows}
    emit(record, format, print_caches)


def backends(format: Format = FORMAT) -> None:
    """List every known target: where it runs (here, or an environment: xbridge environments) or why it cannot; versions
    and device counts."""
    from ..environments import describe_all
    from .tables import print_backends

    rows = describe_all()
    emit(rows, format, print_backends)


def inspect(
    program: str = PROGRAM,
    devices: int = typer.Option(1, help="Devices the mesh spans."),
    mesh: str | None = MESH,
    precision: str | None = typer.Option(None, help="Override the precision (changes parameter bytes)."),
    remat: str | None = REMAT,
    format: Format = FORMAT,
) -> None:
    """Print parameter count, FLOPs per step, the sharding plan and the memory per device (parameters, gradients,
    optimizer state, activations), without running anything."""
    from ..data.source import checked_batch
    from ..memory import estimate
    from ..planner import plan
    from ..torch.flops import flops_per_step
    from .tables import print_inspect

    prog = load_with_overrides(program, precision, mesh=mesh, remat=remat)
    the_plan = plan(prog, devices)
    batch = checked_batch(prog.data, 0, prog.seed)
    info = {"program": prog.name, "config_hash": prog.config_hash, "precision": prog.precision.name,
            "flops_per_step": flops_per_step(prog, batch), "batch_size": prog.data.batch_size,
            "plan": the_plan.to_json(), "memory": estimate(prog, the_plan, batch).to_json()}
    emit(info, format, print_inspect)


def check(
    program: str = PROGRAM,
    backends: str | None = typer.Option(None, "--backends", help="Comma-separated targets to check (also ones this "
                                        "machine cannot run, e.g. jax-tpu: the stacks' tables are the same). "
                                        "Default: every target available here."),
    devices: int = typer.Option(1, help="Devices the mesh spans (sharding and memory per device)."),
    mesh: str | None = MESH,
    precision: str | None = typer.Option(None, help="Override the program's precision."),
    rng: str | None = RNG,
    format: Format = FORMAT,
) -> None:
    """Say, without training, where the program will run and why not: every operator of its step against each
    stack's tables, the constructs that change behaviour on some stack, sharding and memory per device; a verdict
    per target. Exit 0 with the report."""
    from ..check.elsewhere import check_there
    from ..check.job import CheckOptions
    from ..check.job import check as check_job
    from ..environments import available_targets, for_packages
    from .tables import print_check
    from .target_commands import target_list

    prog = load_with_overrides(program, precision, mesh=mesh, rng=rng)
    targets = target_list(backends) or available_targets()
    places = {entry: for_packages(entry) for entry in targets}
    record = check_job(prog, CheckOptions(targets=[name for env, name in places.values() if env is None],
                                          devices=devices))
    flags = ["--devices", str(devices)] + [arg for flag, value in (("--mesh", mesh), ("--precision", precision),
                                                                   ("--rng", rng)) if value for arg in (flag, value)]
    for env in dict.fromkeys(env for env, _ in places.values() if env is not None):
        record.targets += check_there(env, program, {e: name for e, (there, name) in places.items() if there == env},
                                      flags)
    order = {entry: i for i, entry in enumerate(targets)}
    record.targets.sort(key=lambda row: order.get(row.target, len(order)))
    emit(record, format, print_check)
