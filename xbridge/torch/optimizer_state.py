"""The optimizer's state before the first step, as torch.optim creates it at that step.

torch.optim creates its state lazily, inside the first ``step()``; a backend that traces the whole step into one
graph (torch_xla) then compiles two: step 0's without the state, step 1's with it (about 6 s more for the GPT on
xla-cpu, and PJRT's CPU client cannot reload executables). Created here first, step 0 and every later step are the
same graph. The values are torch's own first ones, so the arithmetic is unchanged: Adam/AdamW (torch 2.9
``Adam._init_group``): ``step`` a 0-d zero (on the parameter's device when ``capturable`` or ``fused``, a CPU
float otherwise), ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) ``zeros_like`` the parameter.
SGD with momentum copies the first gradient into its buffer; a zero buffer gives the same first update only without
dampening (``0 * momentum + (1 - 0) * grad`` is ``grad`` exactly), so with dampening the state stays lazy.

One difference: torch creates a parameter's state at the first step that gives it a gradient; here every trainable
parameter gets it. A parameter the loss never reaches is skipped by every update either way (no gradient), but
holds zero state in memory and in checkpoints, which torch would not have."""

from __future__ import annotations

import torch

__all__ = ["create_state"]


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype of Adam's ``step`` (torch 2.9 optim/optimizer.py ``_get_scalar_dtype``)."""
    return torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64


def create_state(optimizer: torch.optim.Optimizer) -> bool:
    """Fill ``optimizer.state`` for every parameter that has none yet; False when this optimizer's first step
    cannot be matched (its state is left to the first step)."""
    entries: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
            if isinstance(optimizer, torch.optim.Adam):      # AdamW is an Adam in torch 2.9
                on_device = group["capturable"] or group["fused"]
                step = (torch.zeros((), dtype=_scalar_dtype(group["fused"]), device=param.device)
                        if on_device else torch.tensor(0.0, dtype=_scalar_dtype(False)))
                state = {"step": step, "exp_avg": zeros,
                         "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            elif isinstance(optimizer, torch.optim.SGD):
                if group["momentum"] == 0:
                    continue                                  # no state at all
                if group["dampening"] != 0:
                    return False
                state = {"momentum_buffer": zeros}
            else:
                return False
            entries[param] = state
    for param, state in entries.items():
        optimizer.state[param] = state
    return True
