"""A backend that compiles for hardware this machine does not have (``xbridge compile``, xbridge/aot/): it declares
it by subclassing :class:`AheadOfTime` next to :class:`~xbridge.contract.Backend`, and the core asks by type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..aot.record import CompiledProgram
    from ..aot.topology import Topology
    from ..ir.program import Program
    from ..planner import ShardingPlan


class AheadOfTime(ABC):
    compiles_for: tuple[str, ...] = ("tpu",)     # the devices it can compile for without having them

    @abstractmethod
    def compile_ahead(self, program: Program, plan: ShardingPlan, topology: Topology, options: dict[str, str],
                      dump: Path | None, which: tuple[str, ...]) -> list[CompiledProgram]:
        """Lower and compile, for ``topology``'s chips, the programs ``run`` would build for ``program`` on
        ``plan`` whose names are in ``which`` (xbridge.aot.record's TRAIN, EVAL, INIT: the train step, the
        evaluation, the initialisation), each as the compiler reports it per chip; a program the
        compiler refuses for lack of memory comes back with ``refused`` set. ``dump``: write each program's
        lowered and optimised text there. Called in a process :func:`xbridge.aot.environment.prepare_process`
        prepared."""

    def compiler_versions(self) -> dict[str, str]:
        return {}


def ahead_of_time(backend: Any) -> AheadOfTime | None:
    return backend if isinstance(backend, AheadOfTime) else None
