"""What the inductor stack changes in torch's private API (written for torch 2.9 to 2.15; xbridge/torch/patches.py
states the rule, holds the version guard and the torch patch every torch stack shares). :func:`skip_vec_isa_probe` and
:func:`debug_trace` run from ``InductorBackend.configure()``, :func:`apply` from ``InductorBackend.lower()``;
:func:`undo` puts back the settings.

- compiler settings (:func:`skip_vec_isa_probe`, :func:`debug_trace`), on torch's config modules, which read their
  environment variables once, when they are imported (building the model on the meta device, the plan, may already
  have done that in this process): ``torch._inductor.config.cpp.vec_isa_ok`` set True when unset (skips the
  build-and-run probe of the CPU's vector ISAs, a ``python -c "import torch ..."`` per ISA, about 2 s each, in every
  process); with ``--dump``, Inductor's debug trace on, its FX graph and AOTAutograd caches off (a cache hit skips
  code generation, and with it the dump) and Dynamo's debug folder under the dump. Kept for the rest of the process
  (every later compile reads them); :func:`undo` puts the values that were there back.
- ``torch._inductor.cpu_vec_isa.VecISA.check_build`` (private), by :func:`remember_isa_probes` from ``configure()``:
  its answer kept on disk. ``cpp.vec_isa_ok`` does not skip the probes of AVX-512 with bf16 and of AMX (their
  ``__bool__`` builds and runs one each, whatever it says), so every process on such a CPU paid a ``python -c
  "import torch ..."`` per probe (1.7-2.0 s for one on an AMD EPYC with avx512_bf16; three on Intel's AMX CPUs).
  The answer depends on the probe's code and flags, the CPU's flags, the compiler and torch: keyed by those, under
  xbridge's inductor cache folder (``isa_probes/``), so the probe runs once per machine (only an answer "builds":
  a failed probe may have failed for a passing reason, and runs again). Undone by :func:`undo`.
- ``torch.amp.GradScaler._unscale_grads_`` (private) overridden by :class:`ShardedGradScaler`, the loss scaler of
  inductor's distributed ranks (fp16-mixed over DTensor gradients). A subclass: torch's class is not changed, and
  there is nothing to undo; its pin is checked by :func:`apply` and by each scaler made.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from xbridge.torch import patches as shared
from xbridge.torch.patches import Patch, PatchSet

COMPILER_SETTINGS = Patch("torch._inductor/_functorch/_dynamo config (vector ISA probe, --dump's trace)", "torch",
                          shared.TORCH)
ISA_PROBES = Patch("torch._inductor.cpu_vec_isa.VecISA.check_build (answers kept on disk)", "torch", shared.TORCH)
GRAD_SCALER = Patch("torch.amp.GradScaler._unscale_grads_ (ShardedGradScaler)", "torch", shared.TORCH)
_PATCHES = PatchSet(COMPILER_SETTINGS, ISA_PROBES, GRAD_SCALER)


def skip_vec_isa_probe() -> None:
    """``torch._inductor.config.cpp.vec_isa_ok = True`` (the caller checks that it is unset)."""
    shared.check(COMPILER_SETTINGS)
    import torch._inductor.config as inductor_config

    _PATCHES.set(inductor_config.cpp, "vec_isa_ok", True)


def remember_isa_probes(folder: Path) -> None:
    """``VecISA.check_build`` answers from ``folder`` when the same probe built and ran on this machine before. Only
    a probe that builds is kept: a failure may be passing (a full disk, a killed probe) and is probed again."""
    shared.check(ISA_PROBES)
    from torch._inductor import cpu_vec_isa

    probe = _PATCHES.original(cpu_vec_isa.VecISA, "check_build")

    def check_build(isa: Any, code: str) -> bool:
        try:
            key = hashlib.sha256("\0".join((code, isa._arch_flags, _machine())).encode()).hexdigest()[:32]
        except Exception:       # no C++ compiler found (torch's probe says so itself), an unreadable /proc
            return bool(probe(isa, code))
        path = folder / f"{key}.json"
        try:
            if json.loads(path.read_text())["builds"] is True:
                return True
        except (OSError, ValueError, KeyError, TypeError):
            pass
        builds = bool(probe(isa, code))
        if builds:
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
                scratch = path.with_name(f".{path.name}.{os.getpid()}")
                scratch.write_text(json.dumps({"builds": True, "isa": str(isa), "flags": isa._arch_flags}))
                os.replace(scratch, path)        # atomic: a process reading it sees all of it or nothing
        return builds

    _PATCHES.set(cpu_vec_isa.VecISA, "check_build", check_build)


@functools.cache
def _machine() -> str:
    """What a probe's answer depends on besides its code: the CPU's flags, the C++ compiler (its path, size and
    time) and torch's version."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                   platform.processor())
    except OSError:
        cpu = platform.processor()
    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    try:
        status = os.stat(compiler)
        compiler += f" {status.st_size} {status.st_mtime_ns}"
    except OSError:
        pass
    return "\0".join((platform.machine(), cpu, compiler, torch.__version__))


def debug_trace(dump: Path) -> None:
    """--dump: Inductor's debug trace on, its caches off, Dynamo's debug folder under ``dump``."""
    shared.check(COMPILER_SETTINGS)
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config as inductor_config

    _PATCHES.set(inductor_config.trace, "enabled", True)
    _PATCHES.set(inductor_config, "fx_graph_cache", False)
    _PATCHES.set(torch._functorch.config, "enable_autograd_cache", False)
    _PATCHES.set(torch._dynamo.config, "debug_dir_root", str(dump / "torch_compile_debug"))


def apply() -> None:
    """Check the pins of the stack's patches and of torch's shared ones (the portable generator's factories)."""
    shared.check_all()
    _PATCHES.check()


def undo() -> None:
    _PATCHES.undo()


class ShardedGradScaler(torch.amp.GradScaler):
    """torch's GradScaler over gradients that are partly DTensors (sharded or replicated on different meshes):
    each rank unscales and checks its own pieces, and the found-inf flag is all-reduced, so every rank takes or
    skips the step together (what torch.distributed.fsdp's ShardedGradScaler does for flat parameters)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        shared.check(GRAD_SCALER)
        super().__init__(*args, **kwargs)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}
