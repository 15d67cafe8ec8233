"""The Inductor backend: torch.compile of the loss (forward and backward) and of the optimizer update
(``inductor-cpu``, ``inductor-cuda``). One device runs in the xbridge process; ``--devices N`` runs N processes on
torch.distributed (gloo on CPU, NCCL on CUDA) with the plan applied through FSDP2 and DTensor (distributed.py),
started by the xbridge process itself or by torchrun (launch.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from xbridge.contract import BackendOption, Executable, Target
from xbridge.contract.checks import Finding, StepChecks
from xbridge.errors import ConfigError
from xbridge.ir.optim import AdamW
from xbridge.plugin import cache_dir
from xbridge.torch.device import TorchDeviceBackend

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan
    from xbridge.torch.op_census import Census


class InductorBackend(TorchDeviceBackend, StepChecks):
    name = "inductor"
    extra = "inductor"
    options = (BackendOption("compile_mode", ("default", "reduce-overhead", "max-autotune"), "default",
                             "torch.compile's mode"),)
    sharded = True

    def operator_support(self, census: Census) -> dict[str, str]:
        """AOTAutograd decomposes with Inductor's table, then Inductor lowers; an operator it has no lowering for
        runs torch's own kernel from the generated code (its fallbacks, and implicit ones)."""
        from torch._inductor import lowering
        from torch._inductor.decomposition import select_decomp_table

        from xbridge.torch.op_census import resolve

        table = select_decomp_table()
        out = {}
        for name in census.ops:
            op = resolve(name)
            if op in table:
                out[name] = "decomposed"
            elif op in lowering.lowerings and op not in lowering.fallbacks:
                out[name] = "lowered"
            else:
                out[name] = "kernel"
        return out

    def construct_findings(self, census: Census, program: Program, options: dict[str, str]) -> list[Finding]:
        """Dynamo breaks the graph where a value is read on the host or a shape comes from the data
        (torch._dynamo.config capture_scalar_outputs and capture_dynamic_output_shape_ops are off): the step runs
        as several compiled pieces with Python between them."""
        found = [Finding("slow", use.name, use.at, "reads a tensor's value on the host (.item(), `if tensor:`): "
                         "Dynamo breaks the graph there, and the step runs as several compiled pieces")
                 for use in census.host_values()]
        found += [Finding("slow", use.name, use.at, "gives a shape that depends on the values: Dynamo breaks the "
                          "graph there") for use in census.data_dependent()]
        # Dynamo replays a float drawn from Python's `random` into the compiled graph as a float64 buffer read as
        # float32 (pytorch/pytorch#198187, open; torch 2.9 and 2.14 measured: x * random.uniform(0.5, 1.5) gave
        # 8.2e36): the step trains on garbage without an error
        found += [Finding("fails", read["what"], read["where"] or "(forward)", "Dynamo hands a float drawn from "
                          "Python's `random` to the compiled step as garbage (pytorch/pytorch#198187: a float64 read "
                          "as float32); draw with torch instead (torch.rand: the same bits on every stack under --rng "
                          "portable)")
                  for read in census.host_reads if read["kind"] == "draw" and "(random)" in read["what"]]
        return found

    def device_count(self, device: str) -> int | None:
        """CPU: any count (one process per device, like the other backends' virtual CPU devices); CUDA: the GPUs
        torch sees here (one process each), or any count under torchrun, which places the processes itself."""
        if device == "cuda" and "WORLD_SIZE" not in os.environ:
            import torch

            return torch.cuda.device_count()
        return None

    def join_processes(self, device: str, devices: int, processes: int | str) -> tuple[int, int]:
        raise ConfigError("--processes: inductor starts its own processes, one per device (--devices N), or runs under "
                          "torchrun (docs/backends/inductor.md); --processes is for jax targets")

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """Inductor's on-disk caches under the user's cache folder (kept between runs), and its debug trace (FX
        graphs, generated code) under --dump.

        ``TORCHINDUCTOR_CACHE_DIR`` is read at each cache access (a value the user set wins). The other settings
        are read once, when their torch config module is imported, which building the model on the meta device
        (the plan) may already have done in this process: they are set on the config modules here, and as
        environment variables for the processes started later (the distributed workers)."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # torch's cache_dir() writes its default into the variable when it finds none, and torch 2.14 calls it
        # before this (the first run in a fresh cache folder then read and wrote /tmp/torchinductor_$USER): a value
        # equal to that default is torch's own, not the user's
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir("inductor"))
        import torch._inductor.config as inductor_config

        from . import patches  # the settings on torch's config modules (patches.py)

        # Skip the build-and-run probe of the CPU's base vector ISAs (torch/_inductor/cpu_vec_isa.py starts a
        # `python -c "import torch ..."` per ISA, about 2 s each, in every process); TORCHINDUCTOR_VEC_ISA_OK=0
        # (the user's) still wins.
        if inductor_config.cpp.vec_isa_ok is None:
            patches.skip_vec_isa_probe()
            os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
        # and the probes that setting does not skip (AVX-512 bf16, AMX) answer once per machine
        patches.remember_isa_probes(cache_dir("inductor") / "isa_probes")
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            os.environ["TORCH_COMPILE_DEBUG"] = "1"
            os.environ["TORCH_COMPILE_DEBUG_DIR"] = str(dump)
            # a cache hit skips code generation, and with it the dump: compile from scratch when dumping
            os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
            os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
            patches.debug_trace(dump)

    def averages_shard_losses(self, options: dict[str, str]) -> bool:
        return True      # one process per device, each with its rows; FSDP2 averages the gradients as DDP does

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from . import patches

        patches.apply()     # the pins of the patches this stack relies on (patches.py)
        mode = options["compile_mode"]
        fp16 = program.precision.loss_scale == "dynamic"
        if target.device == "cpu" and fp16 and isinstance(program.optimizer, AdamW):
            # GradScaler steps the optimizer outside the compiled graph, and AdamW keeps its step count and lr on
            # the device (capturable, so a changing schedule does not recompile), which torch runs uncompiled only
            # on CUDA: torch.optim asserts "If capturable=True, params and state_steps must be on supported devices"
            raise ConfigError(f"{target} cannot train AdamW in fp16-mixed: torch.amp.GradScaler steps the optimizer "
                              "outside the compiled graph, and torch runs a capturable AdamW there only on CUDA; use "
                              "bf16-mixed on inductor-cpu, or fp16-mixed on eager-cpu, jax-cpu or xla-cpu")
        if plan.devices > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from .proxy import DistributedExecutable

            return DistributedExecutable(program, plan, target, mode)
        import torch

        from .executable import InductorExecutable

        return InductorExecutable(program, plan, torch.device(target.device), mode)
