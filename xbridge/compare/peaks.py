"""Peak FLOP/s for MFU: a table of known accelerators (dense, no sparsity), and on CPU a GEMM peak measured on
this machine in the same run.

Sources (vendor datasheets): NVIDIA H100 SXM5 and H200 SXM: 989.4 TFLOPS dense BF16/FP16 tensor core, 67 TFLOPS
FP32 (non-tensor); NVIDIA A100 SXM4: 312 TFLOPS BF16/FP16, 19.5 FP32; NVIDIA L4: 121 BF16, 30.3 FP32 (dense, half
the datasheet's sparse figure); Google Cloud TPU v4: 275 BF16, v5e: 197 BF16, v5p: 459 BF16, v6e (Trillium):
918 BF16 per chip (TPUs run fp32 matmuls through bf16 passes; no separate fp32 peak is published, so fp32 MFU is
reported against the bf16 peak and marked so).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

TABLE: dict[str, dict[str, float]] = {
    # name fragment (lower case, whole words: an "L40S" is not an "L4") -> dtype -> FLOP/s; the first match wins.
    # TPUs by their PJRT device kind (jax's device_kind, torch_xla's xla_device_kind): v4 "TPU v4", v5e "TPU v5
    # lite", v5p "TPU v5", v6e "TPU v6 lite"; and by their accelerator types (xla-tpu: "TPU v5litepod", "TPU v6e").
    "h200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 67e12},
    "h100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 67e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "l4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
    "tpu v4": {"bfloat16": 275e12},
    "tpu v5 lite": {"bfloat16": 197e12},
    "tpu v5e": {"bfloat16": 197e12},
    "tpu v5litepod": {"bfloat16": 197e12},
    "tpu v5p": {"bfloat16": 459e12},
    "tpu v5": {"bfloat16": 459e12},
    "tpu v6e": {"bfloat16": 918e12},
    "tpu v6": {"bfloat16": 918e12},
}


@dataclass(frozen=True)
class Peak:
    flops: float        # per device
    source: str


def known_peak(device_name: str, dtype: str) -> Peak | None:
    name = device_name.lower()
    for fragment, peaks in TABLE.items():
        if re.search(rf"\b{re.escape(fragment)}\b", name):
            if dtype in peaks:
                return Peak(peaks[dtype], f"datasheet {fragment} {dtype}")
            if "bfloat16" in peaks:
                return Peak(peaks["bfloat16"], f"datasheet {fragment} bfloat16 (no {dtype} figure)")
    return None


def measure_cpu_gemm(dtype: str = "float32", size: int = 1024, seconds: float = 1.0) -> Peak:
    """Best FLOP/s of a square torch matmul on this machine's CPU (all threads torch uses), over ``seconds``."""
    import torch

    torch_dtype = getattr(torch, dtype)
    a = torch.randn(size, size).to(torch_dtype)
    b = torch.randn(size, size).to(torch_dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        runs += 1
    flops = 2.0 * size ** 3 / best
    return Peak(flops, f"measured: best of {runs} torch.mm {size}x{size} {dtype} on this CPU "
                       f"({torch.get_num_threads()} threads)")
