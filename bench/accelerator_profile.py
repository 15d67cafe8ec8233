"""Where a GPT-2-small step's GPU time goes (bench/accelerator.sh, on a CUDA machine): torch.profiler over three
training steps of programs/gpt.py:gpt2_small in bf16 autocast, in eager and under torch.compile, GPU kernel time by
kind (matrix products, attention, Triton-fused elementwise/normalisation, other) and the top kernels.

The model, batch and optimizer are the program's own (xbridge.program_file.load_program); the step is written out
here, the way the torch backends run it (autocast forward and loss, backward, clip, AdamW), so that the profiler
sees exactly one training step per ``record_function`` range.

    python bench/accelerator_profile.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from xbridge.program_file import load_program

KINDS = (("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "matmul", "mm_")),
         ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
         ("triton fused", ("triton",)),
         ("optimizer", ("multi_tensor", "adam", "foreach")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profile(compiled: bool, steps: int = 3) -> dict:
    program = load_program(str(Path(__file__).resolve().parents[1] / "programs" / "gpt.py") + ":gpt2_small")
    torch.manual_seed(0)
    model = program.model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batch = {k: torch.from_numpy(v).cuda() for k, v in program.data.batch(0, 0).items()}

    def loss_fn(batch: dict) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return program.loss(model, batch)

    step_loss = torch.compile(loss_fn) if compiled else loss_fn

    def step() -> None:
        loss = step_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(3):   # compile and warm up
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_s = (time.perf_counter() - start) / steps
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        gpu_us = getattr(event, "self_device_time_total", 0.0)
        if gpu_us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.key] = kernels.get(event.key, 0.0) + gpu_us / steps
    by_kind: dict[str, float] = {}
    for name, us in kernels.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us
    gpu_ms = sum(kernels.values()) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return {"mode": "torch.compile" if compiled else "eager", "warmup_s": warm_s, "step_wall_ms": wall_s * 1e3,
            "gpu_busy_ms": gpu_ms, "gpu_idle_fraction": max(0.0, 1 - gpu_ms / (wall_s * 1e3)),
            "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(name[:90], us / 1e3) for name, us in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False); this profile runs on a GPU", file=sys.stderr)
        return 1
    rows = [profile(compiled=False), profile(compiled=True)]
    for row in rows:
        print(f"{row['mode']}: step {row['step_wall_ms']:.1f} ms wall, GPU busy {row['gpu_busy_ms']:.1f} ms "
              f"(idle {row['gpu_idle_fraction']:.0%}); first 3 steps {row['warmup_s']:.1f} s")
        print("  by kind: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row["by_kind_ms"].items()))
        for name, ms in row["top_kernels_ms"]:
            print(f"    {ms:8.2f} ms  {name}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
