"""The torch_xla backend (``xla-cpu``, ``xla-tpu``): torch_xla 2.9 with PJRT, SPMD from the same plan.

torch_xla 2.9 is the last release and has no CUDA support; upstream plans to replace it (TorchTPU). Everything
torch_xla-specific lives in this package, so it can be swapped for its successor without touching the core.
The folder is deliberately not called ``torch_xla``: it would shadow the real package.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from xbridge.contract import Backend, BackendOption, Executable, Target
from xbridge.contract.ahead_of_time import AheadOfTime
from xbridge.contract.checks import Finding, StepChecks
from xbridge.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan
    from xbridge.plugin import CompiledProgram, Topology
    from xbridge.torch.op_census import Census

_PJRT = {"cpu": "CPU", "tpu": "TPU"}
# What a TPU VM has: the chips' device files (v4 and later: /dev/accel*, v5e and later through VFIO: /dev/vfio), or
# TPU_NAME where a launcher names the TPU (read before torch_xla starts: importing it on a machine without one is slow)
TPU_DEVICE_FILES = ("/dev/accel0", "/dev/vfio")
_owned_files: list[str] = []    # files this process made (removed when it exits: registered with the first one)


def _remove_owned() -> None:
    for name in _owned_files:
        Path(name).unlink(missing_ok=True)


class XlaBackend(Backend, AheadOfTime, StepChecks):
    name = "xla"
    devices = ("tpu", "cpu")
    requires = ("torch_xla", "torch")
    extra = "xla"
    # lazy: the whole step traced as lazy tensors by torch_xla.compile (one graph per step).
    # openxla: the loss (forward, and backward through AOTAutograd) captured by Dynamo,
    # torch.compile(backend="openxla"); the optimizer update stays lazy and runs at the step's sync.
    options = (BackendOption("xla_mode", ("lazy", "openxla"), "lazy",
                             "lazy: torch_xla.compile traces the step as lazy tensors; openxla: Dynamo captures the "
                             "loss (torch.compile(backend=\"openxla\"))"),)
    unsupported = {"cuda": "torch_xla 2.9 has no CUDA support (removed upstream; its successor targets TPU): "
                           "use inductor-cuda or jax-cuda"}

    def operator_support(self, census: Census) -> dict[str, str]:
        from .ops import support

        return {name: "host" if status == "fallback" else status for name, status in support(list(census.ops)).items()}

    def construct_findings(self, census: Census, program: Program, options: dict[str, str]) -> list[Finding]:
        """``--xla-mode lazy`` (the default) compiles the step as one XLA graph (``torch_xla.compile(full_graph=
        True)``): a value or a shape the host must know inside it stops it (executable.host_values_named says so at
        the first step). ``--xla-mode openxla`` runs Dynamo, which breaks the graph there instead; with fp16's
        dynamic loss scaling the lazy step is not one graph either (GradScaler reads found_inf on the host)."""
        if options.get("xla_mode") == "openxla" or program.precision.loss_scale == "dynamic":
            why = ("the step runs as several XLA graphs there (--xla-mode openxla: Dynamo breaks the graph; fp16's "
                   "loss scaling: the step is not one graph)")
            found = [Finding("slow", use.name, use.at, "reads a tensor's value on the host (.item(), `if tensor:`): "
                             + why) for use in census.host_values()]
            return found + [Finding("slow", use.name, use.at, "gives a shape that depends on the values: " + why)
                            for use in census.data_dependent()]
        why = ("torch_xla compiles the step as one graph (--xla-mode lazy), which cannot stop for it: the step "
               "fails; write it with fixed shapes (masks, torch.where, a weighted loss), use --xla-mode openxla, or "
               "run it on eager or inductor")
        found = [Finding("fails", use.name, use.at, "reads a tensor's value on the host (.item(), `if tensor:`); "
                         + why) for use in census.host_values()]
        found += [Finding("fails", use.name, use.at, "gives a shape that depends on the values; " + why)
                  for use in census.data_dependent()]
        from .ops import support

        # measured: a forward operator torch_xla runs on the CPU (torch.fft on complex tensors) stops the one-graph
        # step ("Unexpected execution happens inside the compiled function"); a backward one (cdist's) runs
        replaced = census.replaced(program.step.rng)      # the portable sampler runs there instead
        forward = [name for name, use in census.ops.items() if use.forward and name not in replaced]
        found += [Finding("fails", name, census.ops[name].at, "torch_xla has no XLA kernel for it and runs it on "
                          "the CPU, which the one-graph step (--xla-mode lazy) cannot stop for: the step fails; write "
                          "it with other operators, or run it on eager, inductor or jax", operator=True)
                  for name, status in support(forward).items() if status == "fallback"]
        return found

    def device_reason(self, device: str) -> str | None:
        if device == "tpu" and not (any(Path(f).exists() for f in TPU_DEVICE_FILES) or os.environ.get("TPU_NAME")):
            from xbridge.plugin import compile_note

            return ("no TPU here (no /dev/accel* or /dev/vfio device, TPU_NAME unset): xla-tpu runs on a TPU VM"
                    + compile_note("xla-tpu"))
        return None

    def versions(self) -> dict[str, str]:
        return {dist: importlib.metadata.version(dist) for dist in ("torch_xla", "torch")}

    def device_count(self, device: str) -> int | None:
        return None  # CPU: virtual devices, any count; TPU: known once the runtime starts (the executable checks)

    def join_processes(self, device: str, devices: int, processes: int | str) -> tuple[int, int]:
        raise ConfigError("--processes: torch_xla 2.9 runs SPMD over several processes only on a TPU pod (the same "
                          "command on every host) or on CUDA machines under torchrun (one process per machine), and "
                          "its CPU runtime is one process; xbridge runs xla in one process (docs/multi-process.md)")

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """PJRT reads these once, when torch_xla's runtime starts: set them first, per process."""
        os.environ["PJRT_DEVICE"] = _PJRT[device]
        if device == "cpu":
            current = os.environ.get("CPU_NUM_DEVICES")
            if _runtime_started() and current and int(current) != devices:
                raise BackendUnavailable(
                    f"torch_xla in this process already runs with CPU_NUM_DEVICES={current}, not {devices}; torch_xla "
                    "SPMD spans every device of the process: run each device count in its own process")
            os.environ["CPU_NUM_DEVICES"] = str(devices)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            if _runtime_started():
                raise BackendUnavailable("--dump for xla must be given before torch_xla starts in this process")
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
        if not _runtime_started():
            # torch_xla's compilation-cause analysis (read once, when _XLAC loads): level 1 writes one record per
            # XLA compilation (its cause, graph name, Python frames), nothing per execution. The executable reads
            # the records of compilations after warm-up back as recompile reasons. A user's own settings win.
            os.environ.setdefault("PT_XLA_DEBUG_LEVEL", "1")
            if "PT_XLA_DEBUG_FILE" not in os.environ:
                fd, name = tempfile.mkstemp(prefix="xbridge-xla-debug-", suffix=".txt")
                os.close(fd)
                os.environ["PT_XLA_DEBUG_FILE"] = name
                if not _owned_files:
                    atexit.register(_remove_owned)
                _owned_files.append(name)   # ours: removed when the process exits

    def compile_ahead(self, program: Program, plan: ShardingPlan, topology: Topology, options: dict[str, str],
                      dump: Path | None, which: tuple[str, ...]) -> list[CompiledProgram]:
        """The steady-state train step (and the evaluation) torch_xla builds, traced on N virtual CPU devices in a
        process of its own and compiled for ``topology`` by libtpu's compile-only client in another, with torch_xla's
        compile options and libtpu flags (ahead_of_time.py). No initialisation: torch_xla has no program for it."""
        from . import ahead_of_time

        return ahead_of_time.compile_ahead(program, plan, topology, options["xla_mode"], dump, which)

    def compiler_versions(self) -> dict[str, str]:
        from xbridge.plugin import libtpu_version

        return {**self.versions(), "jax": importlib.metadata.version("jax"),
                "libtpu": libtpu_version() or "(TPU_LIBRARY_PATH)"}

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from . import patches
        from .executable import XlaExecutable

        patches.apply(program.step.scan_layers)   # torch_xla's scan made to reuse its loops (patches.py)
        return XlaExecutable(program, plan, target, options["xla_mode"])


def _runtime_started() -> bool:
    """Conservative: once torch_xla is imported, PJRT may have read its environment already."""
    import sys

    return "torch_xla" in sys.modules
