"""``xbridge compile``: resolve the target and the topology, plan the program on the slice's chips, have the backend
compile what ``run`` would build, and add the derived figures (memory against HBM, the roofline bound)."""

from __future__ import annotations

import time
from pathlib import Path

from ..contract import Backend, Target, registry
from ..contract.ahead_of_time import AheadOfTime, ahead_of_time
from ..errors import ConfigError
from ..ir.program import Program
from ..planner import plan as make_plan
from .record import EVAL, INIT, TRAIN, CompiledProgram, CompileReport, roofline
from .topology import Topology


def resolve(target_text: str) -> tuple[Target, Backend, AheadOfTime]:
    """The target and its backend, which must compile ahead of time for that device (it need not be here)."""
    parsed = registry.parse_target(target_text)
    if isinstance(parsed, str):
        parsed = Target(parsed, "tpu")
    loaded = registry.load(parsed.backend)
    if loaded.backend is None:
        raise ConfigError(f"target {target_text} is unavailable: {loaded.error}")
    aot = ahead_of_time(loaded.backend)
    able = [f"{n}-{d}" for n in registry.backend_names() if (b := registry.load(n).backend) is not None
            and (a := ahead_of_time(b)) is not None for d in a.compiles_for]
    if aot is None or parsed.device not in aot.compiles_for:
        raise ConfigError(f"--backend {target_text}: target {parsed} cannot be compiled ahead of time for a "
                          f"topology; targets that can: {', '.join(able) or 'none installed'}")
    return parsed, loaded.backend, aot


def compile_program(program: Program, target_text: str, topology: Topology, backend_options: dict[str, str],
                    dump: Path | None = None) -> CompileReport:
    """What ``run`` would build for ``program`` on ``topology``'s chips, compiled by the real compiler here."""
    from ..run.rng import with_rng
    from ..torch.loss_check import check_loss

    start = time.perf_counter()
    target, backend, aot = resolve(target_text)
    options = backend.resolve_options(backend_options, str(target))
    plan = make_plan(program, topology.chips)        # a batch the slice cannot split is refused here, one line
    check_loss(program)
    programs = aot.compile_ahead(with_rng(program), plan, topology, options, dump, (TRAIN, EVAL, INIT))
    flops = _model_flops(program)
    train = next(p for p in programs if p.name == TRAIN)
    step = program.step
    report = CompileReport(
        program=program.name, target=str(target), topology=topology,
        options={"precision": program.precision.name, "attention": step.attention, "remat": step.remat,
                 "scan_layers": step.scan_layers, "grad_accum": step.grad_accum, **options},
        mesh=dict(plan.axis_sizes), global_batch=program.data.batch_size, model_flops=flops, programs=programs,
        roofline=roofline(train, topology, flops, step.scan_layers), versions=aot.compiler_versions(),
        total_s=0.0, dumped=sorted(str(p) for p in dump.iterdir()) if dump is not None and dump.is_dir() else [])
    report.total_s = time.perf_counter() - start
    return report


def compile_train(program: Program, target_text: str, topology: Topology,
                  backend_options: dict[str, str]) -> CompiledProgram:
    """The train step alone (what ``--fit`` compiles for each candidate)."""
    from ..run.rng import with_rng

    target, backend, aot = resolve(target_text)
    options = backend.resolve_options(backend_options, str(target))
    return aot.compile_ahead(with_rng(program), make_plan(program, topology.chips), topology, options, None,
                             (TRAIN,))[0]


def _model_flops(program: Program) -> int | None:
    from ..torch.flops import flops_per_step

    try:
        return flops_per_step(program, cpu=False)
    except Exception:   # noqa: BLE001 - a model the FLOP counter cannot run: the bound uses XLA's count alone
        return None
