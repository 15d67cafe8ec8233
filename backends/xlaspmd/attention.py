"""Which kernel runs ``F.scaled_dot_product_attention`` on torch_xla (``StepOptions(attention=...)``,
``--attention``).

torch_xla 2.9 runs the call as XLA operations (torch's math form, which XLA fuses as it can): that is ``auto`` and
``math``. ``flash`` routes every call, while the step is traced, to torch_xla's Pallas flash attention
(``torch_xla.experimental.custom_kernel.flash_attention``: JAX's Pallas TPU kernel as an XLA custom call, with a
backward of its own), TPUs only: refused with one line before the first step on any other device, with
``--xla-mode openxla`` and with scanned layers (neither has been tried with the kernel), and for an attention call
with dropout or a sequence the kernel cannot tile (xbridge/torch/fused_attention.py), never left to fall back. The call
is translated as for jax's route (:func:`flash_inputs`): torch's layout as it is, grouped key/value heads
repeated, a mask as the kernel's additive bias ``ab`` (divided by the scale, which the kernel applies after adding
it), torch's scale. Over a mesh of several devices the kernel runs on each device's rows (its ``partition_spec``:
the batch split as the plan splits it, heads, positions and dims whole; torch_xla shards manually around it).

The translation is tested on CPU by handing its output to the Pallas kernel itself in Pallas's TPU interpret mode
(tests/test_attention.py); torch_xla's custom call has not run on a TPU here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xbridge.errors import ConfigError
from xbridge.torch.fused_attention import flash_scale, flash_tiles, masked_bias, no_dropout

MATH = "math (XLA)"
FLASH = "Pallas TPU flash attention (torch_xla custom_kernel)"


def check(attention: str, target: str, device: str, mode: str, scanned: bool) -> None:
    """Refuse (one line) a forced kernel this target cannot run, before anything is traced."""
    if attention not in ("auto", "math", "flash"):
        raise ConfigError(f"StepOptions attention={attention!r} is not available on {target}: torch_xla 2.9 runs "
                          "scaled_dot_product_attention as XLA operations (torch's math form), and xbridge routes it "
                          "to torch_xla's Pallas flash kernel on TPUs; use attention='auto', 'math' or 'flash' "
                          "(xla-tpu)")
    if attention != "flash":
        return
    if device != "tpu":
        raise ConfigError(f"StepOptions attention='flash' is not available on {target}: torch_xla's Pallas flash "
                          "attention kernel (torch_xla.experimental.custom_kernel.flash_attention) runs on TPUs "
                          "only; use attention='auto' or 'math' here, or the target xla-tpu")
    if mode != "lazy" or scanned:
        raise ConfigError(f"StepOptions attention='flash' on {target} is routed with --xla-mode lazy and unscanned "
                          "layers only (the kernel has not been tried under Dynamo or inside torch_xla's scan); "
                          "use --xla-mode lazy and scan_layers=False, or attention='auto'")


def flash_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """torch's attention arguments as the kernel's: ``(q, k, v, ab, sm_scale)``, each of (batch, heads, seq, dim)."""
    lead, (length, dim), kv_length = query.shape[:-2], query.shape[-2:], key.shape[-2]
    flash_tiles((length, kv_length), dim, value.shape[-1])

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-3] if t.dim() > 3 else 1, *t.shape[-2:])

    q, k, v = four(query), four(key), four(value)
    if k.shape[1] != q.shape[1]:        # grouped-query attention: each key/value head serves a group
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scale = flash_scale(scale, dim)
    ab = None
    if attn_mask is not None:       # the kernel scales the sum, (q.k + ab) * scale; torch adds its mask after
        if attn_mask.dtype == torch.bool:
            bias = torch.where(attn_mask, 0.0, masked_bias(scale))
        else:
            bias = attn_mask.float() / scale
        ab = bias.expand(*lead, length, kv_length).reshape(q.shape[0], q.shape[1], length, kv_length)
    return q, k, v, ab, scale


class _Flash(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call, as it is traced, computed by torch_xla's flash kernel."""

    def __init__(self, mesh: Any, batch: Any) -> None:
        super().__init__()
        self.mesh, self.batch = mesh, batch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.flash(*args, **kwargs)

    def flash(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        from torch_xla.experimental.custom_kernel import flash_attention

        no_dropout("flash", dropout_p)
        q, k, v, ab, sm_scale = flash_inputs(query, key, value, attn_mask, scale)
        split = self.mesh is not None and self.mesh.size() > 1
        out = flash_attention(q, k, v, causal=is_causal, sm_scale=sm_scale, ab=ab,
                              partition_spec=(self.batch, None, None, None) if split else None,
                              mesh=self.mesh if split else None)
        return out.reshape(query.shape)


def routed(attention: str, mesh: Any, batch: Any) -> contextlib.AbstractContextManager[Any]:
    """While a step is traced: its attention calls go to the kernel ``attention`` forces (nothing for ``auto`` and
    ``math``). ``batch``: the mesh axis (or axes, or None) the batch dimension is split over."""
    return _Flash(mesh, batch) if attention == "flash" else contextlib.nullcontext()
