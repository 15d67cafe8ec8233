"""--profile on the torch backends (eager, inductor): torch.profiler over the profiled steps (CPU activity, and CUDA
kernels on a GPU), each step inside a ``record_function`` named ``xbridge step N``, exported as a Chrome/Perfetto
trace (``torch_trace.json``: open it in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from xbridge.contract import STEP_MARK

__all__ = ["torch_profiler", "torch_step"]


@contextlib.contextmanager
def torch_profiler(directory: Path, device: torch.device, name: str = "torch_trace.json") -> Iterator[None]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    directory.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(str(directory / name))


def torch_step(step: int) -> Any:
    return torch.profiler.record_function(f"{STEP_MARK} {step}")
