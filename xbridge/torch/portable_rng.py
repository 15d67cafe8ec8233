"""Portable randomness (``--rng portable``): the random numbers a training forward draws, computed with integer tensor
ops inside the step, so every backend, mesh and process draws the same bits.

The generator is Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC
2011; the Random123 reference, and the same function as ``jax.random``'s threefry2x32: tests/test_portable_rng.py
checks it bit for bit against JAX's). It uses only 32-bit add, xor and shifts on int32 tensors (additions wrap;
right shifts are logical ones built from shifts of non-negative values), so it lowers through eager, Inductor,
torch_xla and torchax/JAX (which runs without 64-bit integers) like any other torch code.

Each draw is keyed by (program seed, call site) and counted by (element, step):
- key: the program seed's low 32 bits, and its high 32 bits mixed with the call site (the n-th random call of this
  forward pass, the same on every backend because every backend runs the same Python forward);
- counter: the element's index in the step's global batch and the step number. The run loop hands each example's
  global row index and the step to the loss in the batch (key ``xbridge.rng``, sharded and split into micro-batches
  like the batch itself), so a device or a rank that sees rows 8..15 draws exactly what the unsharded run draws
  for those rows. Tensors whose dimension 0 is not a multiple of the rows' count (not batch-major) are counted
  from 0 over the whole tensor: the same on every backend that sees the whole tensor.

The functions a forward calls are routed here by a TorchFunctionMode that the loss runs under (:func:`portable_loss`):
dropout (``F.dropout``, ``dropout1d/2d/3d``, ``F.scaled_dot_product_attention``'s ``dropout_p``, which is then computed
as attention's math form) and ``torch.rand``, ``randn``, ``rand_like``, ``randn_like``, ``bernoulli``, ``randint``,
``randint_like``. Alpha dropout and the in-place samplers (``uniform_``, ``normal_``, ``bernoulli_``) are refused with
one line: they have no portable form here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xbridge.data.source import RNG_KEY
from xbridge.errors import ProgramError

from .patches import replaced_factories

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _i32(value: int) -> int:
    """A Python int as the signed 32-bit value with the same low 32 bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 words. Only non-negative values are shifted: torch and JAX shift negative ones
    arithmetically, torch_xla 2.9 as a division rounding toward zero (-5 >> 13 is 0 there, -1 in torch); the sign
    bit is put back where the shift takes it."""
    return ((x & 0x7FFFFFFF) >> bits) | ((x < 0).to(torch.int32) << (31 - bits))


def _rotl(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x << bits) | _shr(x, 32 - bits)


def threefry2x32(key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32, 20 rounds: two int32 words of output per pair of int32 counter words, for a 2-word key."""
    ks = (_i32(key[0]), _i32(key[1]), _i32(key[0] ^ key[1] ^ _PARITY))
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for block in range(5):
        for bits in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, bits) ^ x0
        x0 = x0 + ks[(block + 1) % 3]
        x1 = x1 + _i32(ks[(block + 2) % 3] + block + 1)
    return x0, x1


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from the top 24 bits (exact in float32, so every backend compares the same numbers)."""
    return _shr(bits, 8).to(torch.float32) * (1.0 / (1 << 24))


class PortableRandom(TorchFunctionMode):
    """Routes a forward pass's random draws to :func:`threefry2x32`; one instance per loss call (call sites count
    from 0)."""

    def __init__(self, seed: int, rows: torch.Tensor) -> None:
        super().__init__()
        self.seed = seed
        self.rows = rows            # int32 (local rows, 2): global row index, step
        self.site = 0

    # -- counters and bits ------------------------------------------------------------------------------------
    def _bits(self, shape: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        site = self.site
        self.site += 1
        key = (self.seed & 0xFFFFFFFF, ((self.seed >> 32) & 0xFFFFFFFF) ^ (site * 0x9E3779B9))
        rows = self.rows.to(device)
        local = rows.shape[0]
        step = rows[:1, 1]
        if numel and shape and shape[0] % local == 0:
            per_row = numel // local
            within = torch.arange(per_row, dtype=torch.int32, device=device)
            c0 = (rows[:, :1] * per_row + within[None, :]).reshape(shape)
        else:
            c0 = torch.arange(numel, dtype=torch.int32, device=device).reshape(shape)
        c1 = step.reshape((1,) * len(shape)).expand(shape)
        return threefry2x32(key, c0, c1)

    def uniform(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return _uniform(self._bits(shape, device)[0])

    def normal(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """Box-Muller on the two words of each counter."""
        a, b = self._bits(shape, device)
        u1 = 1.0 - _uniform(a)                 # (0, 1]: log is finite
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * _uniform(b))

    # -- the random functions ---------------------------------------------------------------------------------
    def dropout(self, x: torch.Tensor, p: float, training: bool,
                mask_shape: Sequence[int] | None = None) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return x * 0.0
        keep = self.uniform(x.shape if mask_shape is None else mask_shape, x.device) >= p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - p))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                  dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        """scaled_dot_product_attention's math form with the dropout on the attention weights drawn here."""
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if is_causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask)
        weights = self.dropout(torch.softmax(scores, dim=-1), dropout_p, True)
        return weights @ v

    def __torch_function__(self, func: Callable, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is None:
            if func in _REFUSED:
                raise ProgramError(f"{_REFUSED[func]} has no portable form (--rng portable): draw with torch.rand/"
                                    "randn/bernoulli or dropout, or run with --rng native")
            return func(*args, **kwargs)
        return handler(self, *args, **kwargs)


def _dropout(mode: PortableRandom, input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False, train: bool | None = None) -> torch.Tensor:
    return mode.dropout(input, p, training if train is None else train)    # torch.dropout names it ``train``


def _feature_dropout(dims: int) -> Callable[..., torch.Tensor]:
    """dropout1d/2d/3d: one draw per (example, channel), broadcast over the ``dims`` trailing feature dimensions."""
    def run(mode: PortableRandom, input: torch.Tensor, p: float = 0.5, training: bool = True,
            inplace: bool = False) -> torch.Tensor:
        shape = (*input.shape[: input.dim() - dims], *([1] * dims))
        return mode.dropout(input, p, training, shape)
    return run


def _sdpa(mode: PortableRandom, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    return mode.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)


def _creation(sample: str) -> Callable[..., torch.Tensor]:
    def run(mode: PortableRandom, *size: Any, generator: Any = None, dtype: torch.dtype | None = None,
            device: Any = None, requires_grad: bool = False, **_: Any) -> torch.Tensor:
        shape = _size(size)
        where = torch.device(device) if device is not None else mode.rows.device
        out = getattr(mode, sample)(shape, where)
        return out.to(dtype or torch.get_default_dtype()).requires_grad_(requires_grad)
    return run


def _like(sample: str) -> Callable[..., torch.Tensor]:
    def run(mode: PortableRandom, input: torch.Tensor, *, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
        return getattr(mode, sample)(input.shape, input.device).to(dtype or input.dtype)
    return run


def _bernoulli(mode: PortableRandom, input: torch.Tensor, p: float | None = None, *, generator: Any = None,
               **_: Any) -> torch.Tensor:
    probability = input if p is None else torch.full_like(input, p)
    return (mode.uniform(input.shape, input.device) < probability.float()).to(input.dtype)


def _randint(mode: PortableRandom, *args: Any, generator: Any = None, dtype: torch.dtype | None = None,
             device: Any = None, requires_grad: bool = False, **_: Any) -> torch.Tensor:
    """randint(high, size) or randint(low, high, size): floor(u * (high - low)) + low."""
    low, high, size = (0, args[0], args[1]) if len(args) == 2 else args
    where = torch.device(device) if device is not None else mode.rows.device
    u = mode.uniform(_size((size,)), where)
    return (torch.floor(u * float(high - low)) + low).to(dtype or torch.int64)


def _randint_like(mode: PortableRandom, input: torch.Tensor, *args: Any, dtype: torch.dtype | None = None,
                  **_: Any) -> torch.Tensor:
    low, high = (0, args[0]) if len(args) == 1 else args
    u = mode.uniform(input.shape, input.device)
    return (torch.floor(u * float(high - low)) + low).to(dtype or input.dtype)


_HANDLERS: dict[Callable, Callable[..., torch.Tensor]] = {
    F.dropout: _dropout,
    torch.dropout: _dropout,
    F.dropout1d: _feature_dropout(1),
    F.dropout2d: _feature_dropout(2),
    F.dropout3d: _feature_dropout(3),
    F.scaled_dot_product_attention: _sdpa,
    torch.rand: _creation("uniform"),
    torch.randn: _creation("normal"),
    torch.rand_like: _like("uniform"),
    torch.randn_like: _like("normal"),
    torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli,
    torch.randint: _randint,
    torch.randint_like: _randint_like,
}
_REFUSED: dict[Callable, str] = {
    F.alpha_dropout: "F.alpha_dropout", F.feature_alpha_dropout: "F.feature_alpha_dropout",
    torch.Tensor.uniform_: "Tensor.uniform_", torch.Tensor.normal_: "Tensor.normal_",
    torch.Tensor.bernoulli_: "Tensor.bernoulli_", torch.randperm: "torch.randperm", torch.normal: "torch.normal",
    torch.multinomial: "torch.multinomial", torch.Tensor.exponential_: "Tensor.exponential_",
}


# The factories that take no tensor are not in torch.overrides.get_overridable_functions(), so Dynamo (inductor,
# xla's openxla mode) does not route them to a TorchFunctionMode, as eager torch does. Around a compiled loss call
# (:func:`factories`) they are replaced by forwarders to the active generator (_ACTIVE), which Dynamo traces as
# Python; outside a portable loss the forwarders call the original. The replacement itself is a patch of torch
# (xbridge/torch/patches.py).
_ACTIVE: list[PortableRandom] = []
_ORIGINAL = {f.__name__: f for f in (torch.rand, torch.randn, torch.randint)}


def _forwarder(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    handler = _HANDLERS[original]

    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not _ACTIVE:
            return original(*args, **kwargs)
        return handler(_ACTIVE[-1], *args, **kwargs)

    factory.__name__ = factory.__qualname__ = f"portable_{original.__name__}"
    return factory


_FORWARDERS = {name: _forwarder(original) for name, original in _ORIGINAL.items()}


def factories() -> contextlib.AbstractContextManager[None]:
    """``torch.rand``, ``randn`` and ``randint`` forwarded to the portable generator while a (compiled) loss runs,
    and put back after (:func:`xbridge.torch.patches.replaced_factories`)."""
    return replaced_factories(_FORWARDERS)


def portable_loss(loss: Callable[[Any, dict[str, Any]], Any], seed: int) -> Callable[[Any, dict[str, Any]], Any]:
    """The program's loss with its forward's random draws made portable. The batch's ``xbridge.rng`` entry is taken
    out before the user's loss sees the batch; a batch without it (evaluation, a FLOP count, a module trace) runs
    the loss as it is."""

    def loss_with_portable_rng(model: Any, batch: dict[str, Any]) -> Any:
        if RNG_KEY not in batch:
            return loss(model, batch)
        batch = dict(batch)
        mode = PortableRandom(seed, batch.pop(RNG_KEY))
        _ACTIVE.append(mode)
        try:
            with mode:
                return loss(model, batch)
        finally:
            _ACTIVE.pop()

    loss_with_portable_rng.portable_rng = True    # type: ignore[attr-defined]  # (xbridge.run.rng.with_rng)
    loss_with_portable_rng.user_loss = loss       # type: ignore[attr-defined]  # (program_file.source_of)
    return loss_with_portable_rng


# -- finding the random draws of a program (parity under --rng native) ------------------------------------------------
_DROPOUTS = {F.dropout: "dropout", torch.dropout: "dropout", F.dropout1d: "dropout1d", F.dropout2d: "dropout2d",
             F.dropout3d: "dropout3d", F.alpha_dropout: "alpha_dropout", F.feature_alpha_dropout: "alpha_dropout"}


class _Recorder(TorchFunctionMode):
    """Notes each random draw of a forward pass with the module it happened in."""

    def __init__(self, where: list[str]) -> None:
        super().__init__()
        self.where = where
        self.found: list[tuple[str, str]] = []

    def __torch_function__(self, func: Callable, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = None
        if func in _DROPOUTS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            name = _DROPOUTS[func] if training and p > 0 else None
        elif func is F.scaled_dot_product_attention:
            p = args[5] if len(args) > 5 else kwargs.get("dropout_p", 0.0)
            name = "scaled_dot_product_attention(dropout_p)" if p > 0 else None
        elif func in _HANDLERS or func in _REFUSED:
            name = getattr(func, "__name__", str(func))
        if name is not None:
            self.found.append((self.where[-1] if self.where else "(loss)", name))
        return func(*args, **kwargs)


def random_draws(program: Any, batch: dict[str, Any]) -> list[tuple[str, str]]:
    """(module, op) of every random draw one training forward of ``program`` makes, in execution order: the model
    built on the meta device and the loss run on a meta ``batch`` (shapes only, no arithmetic)."""
    from xbridge.weights import meta_model

    model = meta_model(program)
    model.train()
    where: list[str] = []
    handles = []
    def enter(name: str) -> None:
        where.append(name or "(model)")

    def leave() -> None:    # returns None: a forward hook's result would replace the module's output
        where.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: enter(name)))
        handles.append(module.register_forward_hook(lambda m, a, o: leave()))
    meta = {k: torch.empty(v.shape, dtype=torch.from_numpy(v[:0]).dtype, device="meta") for k, v in batch.items()}
    recorder = _Recorder(where)
    try:
        with recorder:
            program.loss(model, meta)
    finally:
        for handle in handles:
            handle.remove()
    return recorder.found


def active_mode() -> PortableRandom | None:
    """The portable generator of the loss call running now, or None (``--rng native``, or outside a loss call)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def replaying(mode: PortableRandom, site: int) -> Iterator[None]:
    """Draw again from call site ``site`` on: a layer recomputed by activation checkpointing (during the backward
    pass, after the loss call has left its mode) draws the bits its forward drew. Afterwards the count of sites is
    where it was, or past the replayed ones when this is the first run. The mode is entered again even when it is
    active: a layer run as a JAX function (torchax) has torchax's own mode above it, which would see the layer's
    operations first."""
    resume, mode.site = mode.site, site
    _ACTIVE.append(mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.pop()
        mode.site = max(resume, mode.site)
