"""The Inductor executable: the shared torch train step with the loss and the optimizer update compiled.

One process and one device; the distributed rank engine (rank_engine.py) is this executable with a distributed
train step and the plan applied to the model, so both count compilations the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from xbridge.contract import CompileCache
from xbridge.ir.program import Program
from xbridge.plugin import ShardingPlan
from xbridge.torch.capabilities import TorchDiagnostics
from xbridge.torch.executable import TorchExecutable
from xbridge.torch.train import TrainStep

from . import layer_scan


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def cache_counts() -> tuple[int, int]:
    """Hits and misses of Inductor's FX-graph cache and AOTAutograd's cache in this process so far."""
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return int(hits), int(misses)


# torch's ``dynamo_timed`` phases reported per run (nested: the first holds the others)
PHASES = {"_compile.compile_inner": "Dynamo capture + backend (all)", "bytecode_tracing": "Dynamo bytecode tracing",
          "OutputGraph.call_user_compiler": "AOTAutograd + Inductor", "fx_codegen_and_compile": "Inductor codegen",
          "compile_file": "C++ compile", "PyCodeCache.load_by_key_path": "load compiled modules"}


def phase_seconds() -> dict[str, float]:
    """Seconds per compile phase in this process so far, as torch._dynamo times them."""
    return {label: float(sum(compilation_time_metrics.get(name, ()))) for name, label in PHASES.items()}


class InductorDiagnostics(TorchDiagnostics):
    """Compilations counted by Dynamo (recompiles after warm-up, graph breaks), the compile caches' hits and the
    compile phases since the executable was built, and what TORCH_COMPILE_DEBUG wrote."""

    def __init__(self, executable: TorchExecutable) -> None:
        super().__init__(executable)
        self.warm_graphs = 0
        self._cache_start, self._seconds_start = cache_counts(), phase_seconds()

    def recompiles(self) -> int:
        return compiled_graphs() - self.warm_graphs

    def recompile_reasons(self) -> list[str]:
        return [f"graph break x{count}: {reason}" for reason, count in counters["graph_break"].items()]

    def mark_warm(self) -> None:
        self.warm_graphs = compiled_graphs()

    def compile_cache(self) -> CompileCache | None:
        (hits, misses), (hits0, misses0) = cache_counts(), self._cache_start
        seconds = {name: round(value - self._seconds_start.get(name, 0.0), 3)
                   for name, value in phase_seconds().items() if value - self._seconds_start.get(name, 0.0) > 0}
        return CompileCache(hits - hits0, misses - misses0, "Inductor FX-graph cache + AOTAutograd cache", seconds)

    def dump(self, directory: Path) -> list[Path]:
        # TORCH_COMPILE_DEBUG (set by the backend's configure) wrote the FX graphs and Inductor's output code here.
        return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".log"))


class InductorExecutable(TorchExecutable):
    train_step_class: type[TrainStep] = TrainStep
    diagnostics_class: type[TorchDiagnostics] = InductorDiagnostics
    foreach = True     # the multi-tensor optimizer update: a smaller graph that compiles in a fraction of the time

    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device, mode: str) -> None:
        super().__init__(program, plan, device)
        self.mode = mode

    def compiler(self) -> Callable[[Callable], Callable]:
        mode = None if self.mode == "default" else self.mode
        return lambda fn: torch.compile(fn, mode=mode)

    scanned: str | None = None     # the path of the layers made one compile region

    def scan_layers(self, model: torch.nn.Module) -> bool:
        self.scanned = layer_scan.apply(model, self.program)
        return self.scanned is not None and self.program.step.remat != "none"    # recomputed inside the region

    def make_train_step(self, model: torch.nn.Module) -> TrainStep:
        # lr and Adam's step count on the device (on_device): a changing schedule does not recompile the update.
        return self.train_step_class(self.program, model, self.device, on_device=True, compile=self.compiler(),
                                     foreach=self.foreach)
