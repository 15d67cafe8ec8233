"""The diagnostics and probes of the distributed executable (proxy.py), collaborators of it: a question every rank
must answer together (a collective inside: the layout, the recompiles, a probe's forward pass) goes to all ranks
through the proxy's call; one about what was compiled goes to rank 0's engine alone (every rank compiles the same
graphs). Its profiler is rank 0's engine's (rank 0's work and its waits in the collectives)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xbridge.contract import CompileCache, Diagnostics, Probes

if TYPE_CHECKING:
    from .proxy import DistributedExecutable


class RankDiagnosis(Diagnostics):
    def __init__(self, executable: DistributedExecutable) -> None:
        self.ex = executable

    def _rank0(self) -> Diagnostics:
        found = self.ex.engine.capability(Diagnostics)
        assert found is not None     # the rank engine's (backends/inductor/rank_engine.py)
        return found

    def nonfinite_grads(self) -> list[str]:
        return self.ex.call("nonfinite_grads")[0]

    def layout(self) -> dict[str, dict[str, Any]]:
        return self.ex.call("layout")[0]

    def recompiles(self) -> int:
        return self.ex.call("recompiles")[0]

    def mark_warm(self) -> None:
        self.ex.call("mark_warm")

    def recompile_reasons(self) -> list[str]:
        return self._rank0().recompile_reasons()

    def dump(self, directory: Path) -> list[Path]:
        return self._rank0().dump(directory)

    def device_kind(self) -> str | None:
        return self._rank0().device_kind()

    def device_peak_bytes(self) -> int | None:
        return self._rank0().device_peak_bytes()

    def compile_cache(self) -> CompileCache | None:
        return self._rank0().compile_cache()


class RankProbes(Probes):
    """Each probe runs on every rank (FSDP2 gathers the parameters for the forward pass); rank 0's answer."""

    def __init__(self, executable: DistributedExecutable) -> None:
        self.ex = executable

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.ex.call("trace_modules", batch)[0]

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        return self.ex.call("trace_gradients", batch)[0]

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        return self.ex.call("matmul_dtypes", batch)[0]

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        return self.ex.call("attention_kernels", batch)[0]
