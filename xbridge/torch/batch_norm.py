"""torch's ``native_batch_norm`` written in plain torch ops, for backends whose own kernel gets the running statistics
wrong: torchax 0.0.13 computes them and drops them; torch_xla 2.9 updates the running variance with the biased
variance. torch's semantics: the output is normalised with the biased batch variance; the running mean and variance
are updated in place with ``momentum``, the variance with Bessel's correction n/(n-1) (n: values per channel). As on
torch's CPU kernel, bfloat16/float16 input is normalised in float32 and the output comes back in the input's dtype
(bf16-mixed: bfloat16 activations with float32 weights give bfloat16)."""

from __future__ import annotations

import torch


def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's native_batch_norm in torch ops (the running statistics updated in place): the output, the batch
    mean and the inverse standard deviation (empty in eval mode), as torch's backward formula expects them."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    out_dtype = x.dtype
    stat_dtype = weight.dtype if weight is not None else x.dtype
    x = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    if training:
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        var = ((x - mean.view(shape)) ** 2).mean(dims)       # biased, as torch normalises with
        count = x.numel() // x.shape[1]
        with torch.no_grad():
            if running_mean is not None:
                running_mean.copy_((1 - momentum) * running_mean + momentum * mean.detach())
            if running_var is not None:
                unbiased = var.detach() * (count / max(count - 1, 1))
                running_var.copy_((1 - momentum) * running_var + momentum * unbiased)
        invstd = torch.rsqrt(var + eps)
        saved_mean, saved_invstd = mean.to(stat_dtype), invstd.to(stat_dtype)
    else:
        assert running_mean is not None and running_var is not None
        mean, invstd = running_mean.to(x.dtype), torch.rsqrt(running_var.to(x.dtype) + eps)
        saved_mean = saved_invstd = x.new_empty((0,), dtype=stat_dtype)
    out = (x - mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape).to(x.dtype)
    if bias is not None:
        out = out + bias.view(shape).to(x.dtype)
    return out.to(out_dtype), saved_mean, saved_invstd


def batch_norm_no_training(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                           running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)
