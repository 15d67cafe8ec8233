"""torch.autocast's CPU policy on XLA (bf16-mixed, fp16-mixed): kernels at ``AutocastXLA`` for the operators where
torch_xla 2.9's own autocast list differs from torch's (xbridge/torch/autocast.py says which and why).

Each kernel casts its inputs as torch.autocast("cpu") would, then runs the operator below the autocast key, as
torch's own C++ autocast kernels do; autograd records the casts. Registered once per process, with the other XLA
kernels (backends/xlaspmd/ops.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from xbridge.torch.autocast import KEEP, XLA_CORRECTIONS, cast_inputs


def _kernel(op: torch._ops.OpOverload, policy: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_inputs(policy, args, kwargs, torch.get_autocast_dtype("xla"))
        with torch.autocast("xla", enabled=False):      # below the autocast key (torch's own kernels exclude it)
            return op(*args, **kwargs)
    return kernel


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def register(library: torch.library.Library, policies: dict[str, str] = XLA_CORRECTIONS) -> None:
    with warnings.catch_warnings():    # torch_xla's own autocast kernels are replaced on purpose
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        for name, policy in policies.items():
            # KEEP: fall through to the next key with autocast still on, so that what the operator decomposes
            # into is autocast (einsum's bmm is cast as on the CPU)
            kernel = torch.library.fallthrough_kernel if policy == KEEP else _kernel(_overload(name), policy)
            library.impl(name, kernel, "AutocastXLA")
