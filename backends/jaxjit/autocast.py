"""torch.autocast's semantics for torchax (bf16-mixed, fp16-mixed on jax).

torchax 0.0.13 applies a copy of torch's CPU op policy (``torchax.amp.autocast_policy``) whenever its environment
has an ``autocast_dtype``, through ``torchax.amp.execute_policy``. Two things differ from torch.autocast, and real
models meet both (a Hugging Face Llama's rotary embedding):

- its ``promote`` reads ``.dtype`` off every argument and crashes on a list (``torch.cat((freqs, freqs))``);
- it ignores the model's own ``torch.autocast(..., enabled=False)`` regions, so what the model computes in float32
  on purpose (the rotary angles) would run in bfloat16.

Here the policy function is replaced by torch's (xbridge/torch/autocast.py: lists included, float64 left alone),
and it follows torch's own autocast state for the ``jax`` device type, which torch tracks with nesting like any
other (torchax registers ``jax`` as torch's privateuse1 backend): the step runs inside ``torch.autocast("jax",
dtype)``, and a model's ``torch.autocast(device_type=x.device.type, enabled=False)`` turns the casts off inside its
region. torch hides that state below the dispatcher's autocast keys, where torchax handles aten operators
(``torch.is_autocast_enabled`` reads False there), so :class:`AutocastState`, a function mode, reads it at each torch
call above them and the hook uses that reading.

torchax lowers some torch functions before they reach aten (``F.linear``, ``F.scaled_dot_product_attention``,
``torch.einsum``, ...), and sees others only after the decomposition that torch casts above (the convolutions reach
it as ``aten.convolution``), so the aten-keyed table never sees them: :data:`FUNCTION_POLICY` adds them under torch's
policy. Measured: without it a bf16-mixed GPT step ran every matmul in float32, and a convolution stayed float32.

Both the hook and the table's additions are installed by backends/jaxjit/patches.py (applied when a
``JaxExecutable`` is built).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torchax.amp import CastPolicy

from xbridge.torch.autocast import FP32, LOWER, PROMOTE, cast_inputs

FUNCTION_POLICY: dict[Any, CastPolicy] = {
    torch.nn.functional.linear: CastPolicy.LOWER_PRECISION_FP,
    torch.nn.functional.scaled_dot_product_attention: CastPolicy.LOWER_PRECISION_FP,
    torch.einsum: CastPolicy.LOWER_PRECISION_FP,
    # torch casts at conv1d/conv2d/conv3d/conv_transpose*, above their decomposition; torchax sees aten.convolution
    torch.ops.aten.convolution.default: CastPolicy.LOWER_PRECISION_FP,
    # a Conv1d's input and bias reach torch's dtype check before the decomposition (a bf16 input, a float32 bias)
    torch.nn.functional.conv1d: CastPolicy.LOWER_PRECISION_FP,
    torch.cdist: CastPolicy.FP32,
    torch.linalg.solve: CastPolicy.FP32,
    torch.linalg.svd: CastPolicy.FP32,
    torch.svd: CastPolicy.FP32,
    # torch runs the FFTs in float32 under autocast (fft_* in its fp32 list, above their decomposition); torchax
    # sees the aten ops they decompose to (a bf16 input would reach jnp.fft, which refuses it)
    torch.ops.aten._fft_r2c.default: CastPolicy.FP32,
    torch.ops.aten._fft_c2r.default: CastPolicy.FP32,
    torch.ops.aten._fft_c2c.default: CastPolicy.FP32,
}
_POLICY = {CastPolicy.LOWER_PRECISION_FP: LOWER, CastPolicy.FP32: FP32, CastPolicy.PROMOTE: PROMOTE}


_state = threading.local()      # .dtype: the autocast dtype for "jax" at the latest torch call, None when off


class AutocastState(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _state.dtype = torch.get_autocast_dtype("jax") if torch.is_autocast_enabled("jax") else None
        return func(*args, **(kwargs or {}))


def execute_policy(policy: CastPolicy, args: Any, kwargs: Any, target_lower_fp: torch.dtype) -> tuple[Any, Any]:
    """torchax's hook, with torch's semantics, in the autocast dtype :class:`AutocastState` last read."""
    dtype = getattr(_state, "dtype", None)
    if dtype is None:
        return args, kwargs
    return cast_inputs(_POLICY[policy], args, kwargs, dtype)


@contextlib.contextmanager
def compute_autocast(env: Any, dtype: torch.dtype | None) -> Iterator[None]:
    """The step's autocast: ``dtype`` (the precision's compute dtype when it is mixed) or none. torchax consults
    the policy only while its environment has an autocast dtype, so it always has one here; torch's autocast state
    for ``jax`` decides (off unless the step or the model turns it on)."""
    with env.override_property(autocast_dtype=dtype or torch.bfloat16), \
            torch.autocast("jax", dtype=dtype or torch.bfloat16, enabled=dtype is not None), AutocastState():
        try:
            yield
        finally:
            _state.dtype = None
