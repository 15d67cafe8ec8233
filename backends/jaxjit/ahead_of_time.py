"""``xbridge compile`` on jax: the executable ``run`` builds (executable.py), built abstractly on a TPU topology's
compile-only devices (``jax.experimental.topologies``, libtpu's compile-only client), its train step, evaluation and
optimizer-state initialisation lowered and compiled by the TPU compiler, and what the compiler reports read per chip.

JAX's persistent compilation cache is off here: compile-only executables cannot be serialised into it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from xbridge.contract import Target
from xbridge.errors import LoweringError
from xbridge.plugin import EVAL, INIT, TRAIN, CompiledProgram, checked_batch, measure, rng_rows
from xbridge.torch.weights import meta_model

from . import step_builders
from .checkpoint_shards import abstract
from .feeding import to_jax_dtype
from .lowering import matmul_precision

if TYPE_CHECKING:
    from xbridge.ir.program import Program
    from xbridge.plugin import ShardingPlan, Topology

    from .executable import JaxExecutable


def build(program: Program, plan: ShardingPlan, devices: list[Any], mode: str) -> JaxExecutable:
    """The executable ``run`` would build, on ``devices`` (compile-only), with abstract weights."""
    from .executable import JaxExecutable

    ex = JaxExecutable(program, plan, Target("jax", "tpu"), mode, devices=devices)
    shapes = {name: abstract(value, ex.replicated) for name, value in meta_model(program).state_dict().items()}
    ex.init(shapes)
    return ex


def abstract_batch(ex: JaxExecutable) -> dict[str, jax.ShapeDtypeStruct]:
    """Batch 0's shapes and dtypes (one batch is read on the host), split as the plan says."""
    float_dtype = jax.numpy.dtype(ex.program.precision.params)
    host = checked_batch(ex.program.data, 0, ex.program.seed, rng_rows(ex.program))    # --rng portable's rows too
    return {k: jax.ShapeDtypeStruct(v.shape, to_jax_dtype(v[:1], float_dtype).dtype, sharding=ex.batch_sharding)
            for k, v in host.items()}


def compile_programs(ex: JaxExecutable, dump: Path | None, which: tuple[str, ...]) -> list[CompiledProgram]:
    """The train step (what ``step`` calls), the evaluation (``evaluate``) and the optimizer state's
    initialisation (the only device program ``init`` runs: the weights are copied, not computed)."""
    batch = abstract_batch(ex)
    state = ex.state
    programs = {TRAIN: lambda: (ex.jitted, (state, batch)),
                EVAL: lambda: (step_builders.eval_step(ex), (state["params"], state["buffers"], batch)),
                INIT: lambda: (jax.jit(ex.tx.init, out_shardings=ex.state_shardings["opt"]),
                               ({n: state["params"][n] for n in ex.trained_keys},))}
    return [lower_and_compile(ex, name, *programs[name](), dump) for name in which]


def lower_and_compile(ex: JaxExecutable, name: str, fn: Any, args: tuple[Any, ...],
                      dump: Path | None) -> CompiledProgram:
    """Lower and compile ``fn`` for the topology; the compiler's figures per chip."""
    start = time.perf_counter()
    try:
        with matmul_precision(ex.program.precision.compute):
            lowered = fn.lower(*args)
    except NotImplementedError as exc:      # e.g. a Mosaic kernel outside shard_map: JAX's lowering refuses
        raise LoweringError(f"jax could not lower the {name} of program {ex.program.name!r} for TPU: "
                            f"{str(exc).strip().splitlines()[0]}") from None
    lowered_s = time.perf_counter() - start
    what = f"the {name} of program {ex.program.name!r}"
    start = time.perf_counter()
    try:
        done = lowered.compile()
    except Exception as exc:  # noqa: BLE001 - out of memory is a result (measure.refused), the rest an error
        return measure.refused(name, what, lowered_s, time.perf_counter() - start, exc)
    compile_s = time.perf_counter() - start
    text = done.as_text()
    if dump is not None:
        measure.write_dump(dump, name, {"stablehlo.mlir": lowered.as_text(), "tpu.optimized.hlo.txt": text})
    return measure.compiled(name, lowered_s, compile_s, done.memory_analysis(), done.cost_analysis(), text)


def compile_ahead(program: Program, plan: ShardingPlan, topology: Topology, mode: str,
                  dump: Path | None, which: tuple[str, ...]) -> list[CompiledProgram]:
    devices = measure.topology_devices(topology)
    with measure.no_persistent_cache():
        return compile_programs(build(program, plan, devices, mode), dump, which)
