"""What every backend does with the TPU compiler's answer, in one place: the slice's compile-only devices (JAX's
client over libtpu, which jax-tpu and xla-tpu both compile through), and a compiled program's figures read per chip
(memory statistics, cost analysis, optimised HLO text) or its out-of-memory refusal."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable, LoweringError
from ..files import write_text
from . import hlo
from .record import CompiledProgram
from .topology import Topology


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache kept out of compile-only compiles (it cannot serialise their
    executables: ``serialize_executable(): incompatible function arguments``). Turning the cache off is not enough in
    a process that already used it (JAX keeps the opened cache), so writes are also held back by the minimum compile
    time; both settings are put back after."""
    import jax

    saved = (jax.config.jax_enable_compilation_cache,
             jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def topology_devices(topology: Topology) -> list[Any]:
    """The slice's compile-only devices (every chip of every host, from this one process), through
    ``jax.experimental.topologies`` (jax imported here, in a process :func:`environment.prepare_process` set up)."""
    from jax.experimental import topologies

    try:
        found = topologies.get_topology_desc(**topology.jax_kwargs())  # type: ignore[arg-type]
    except Exception as exc:        # libtpu refuses the name or cannot load: one line, with its reason
        raise BackendUnavailable(f"libtpu could not describe TPU topology {topology.jax_name!r} "
                                 f"(--topology {topology.asked}): {str(exc).strip().splitlines()[0]}") from None
    devices = list(found.devices)
    if len(devices) != topology.chips:
        raise BackendUnavailable(f"libtpu describes TPU topology {topology.jax_name!r} with {len(devices)} devices, "
                                 f"not the {topology.chips} chips of --topology {topology.asked}")
    return devices


def refused(name: str, what: str, lower_s: float, compile_s: float, exc: BaseException) -> CompiledProgram:
    """The compiler's refusal of ``what`` (e.g. "the train step of program 'gpt'"): out of memory is a result (the
    program does not fit, with the bytes the compiler says it needed); anything else one LoweringError line."""
    found = hlo.out_of_memory(str(exc))
    if found is None:
        raise LoweringError(f"the TPU compiler refused {what}: {str(exc).strip().splitlines()[0]}") from None
    return CompiledProgram(name, round(lower_s, 3), round(compile_s, 3), refused=found[0], refused_bytes=found[1])


def compiled(name: str, lower_s: float, compile_s: float, memory: Any, cost: Any, text: str) -> CompiledProgram:
    """A compiled program per chip from the compiler's memory statistics (``CompiledMemoryStats``), its cost
    analysis (a dict, or a list of one) and its optimised HLO text."""
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})
    return CompiledProgram(
        name, round(lower_s, 3), round(compile_s, 3),
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes), peak_bytes=int(memory.peak_memory_in_bytes),
        flops=_number(cost.get("flops")), bytes_accessed=_number(cost.get("bytes accessed")),
        collectives=hlo.collectives(text), kernels=hlo.custom_calls(text))


def write_dump(dump: Path | None, name: str, texts: dict[str, str]) -> None:
    """``--dump DIR``: each text under ``DIR/<program>.<suffix>`` (``train_step.tpu.optimized.hlo.txt``)."""
    if dump is None:
        return
    dump.mkdir(parents=True, exist_ok=True)
    for suffix, text in texts.items():
        write_text(dump / f"{name.replace(' ', '_')}.{suffix}", text)


def _number(value: Any) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
