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

The functions a forward calls are routed here by a TorchFunctionMode that the loss runs under (:func:`portable_loss`);
each draw is one call site, and each is derived from the 32-bit words (u: the top 24 bits as a float32 in [0, 1);
u': (top 23 bits + 1/2) / 2^23, in (0, 1), where a logarithm or a tangent follows):
- dropout (``F.dropout``, ``dropout1d/2d/3d``, ``F.scaled_dot_product_attention``'s ``dropout_p``, which is then
  computed as attention's math form): keep where u >= p;
- ``torch.rand``, ``rand_like``: u (with as many bits as a float16/bfloat16 holds, so never 1 after the cast);
  ``randn``, ``randn_like``, ``Tensor.normal_(mean, std)``, ``torch.normal`` (Tensor/Tensor, Tensor/float,
  float/Tensor broadcast, float/float/size; no gradient to mean and std, torch's is zero): Box-Muller on both words;
  ``Tensor.log_normal_(mean=1, std=2)``: exp of that normal;
- ``bernoulli``, ``Tensor.bernoulli``, ``Tensor.bernoulli_(p)`` (p a float or a tensor): 1 where u < p;
  ``Tensor.uniform_(from, to)``: from + (to - from) u;
- ``Tensor.exponential_(lambd)``: -log(u') / lambd (never 0, as torch's); ``Tensor.geometric_(p)``:
  ceil(log(u') / log1p(-p)) in 1, 2, ...; ``Tensor.cauchy_(median, sigma)``: median + sigma tan(pi (u' - 1/2));
- ``randint``, ``randint_like``, ``Tensor.random_()`` / ``random_(to)`` / ``random_(from, to)`` (torch's ranges:
  [0, 2^digits] for a float, [0, max] for an integer type): low + (top 31 bits mod span), spans up to 2^31 inside
  int32's range (int64 is int32 on JAX), bias below span / 2^31;
- ``torch.randperm(n)``: argsort of one int32 key per position, the word with its low ceil(log2 n) bits replaced by
  the position (distinct keys: the same order whatever a stack's sort does with ties);
- ``torch.multinomial`` / ``Tensor.multinomial``: with replacement by inverse CDF (how many cumulative weights are
  <= u * total), without by Gumbel-top-k (the k smallest log(-log u') - log w; zero weights last, in index order).
The in-place samplers draw for the tensor's shape and ``copy_`` the sample into it, returning it (``x.new_empty(shape)
.bernoulli_(p)``, timm's DropPath, works unchanged on every stack). The integer draws and the comparisons are the same
bits everywhere; the ones through log, cos or tan carry each stack's own rounding of those functions (an ulp).
Refused with one line, as are random_/randint spans past int32: alpha dropout, ``rrelu`` in training, ``poisson``,
``binomial``, the Gamma/Dirichlet samplers. ``generator=`` is accepted and ignored.

The generator and its floats are in threefry.py, the functions routed here in portable_samplers.py; this module
holds the generator's state (:class:`PortableRandom`), the loss wrapper and the search for a program's draws.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xbridge.data.source import RNG_KEY
from xbridge.errors import ProgramError

from .patches import replaced_factories
from .portable_samplers import _HANDLERS, _REFUSED, _TRAINING_ONLY, _trains
from .threefry import _DIGITS, _INT32, _open_uniform, _refuse, _shr, _uniform, threefry2x32

# torch functions whose own body draws (nn.MultiheadAttention's forward: its attention dropout, through
# scaled_dot_product_attention's dropout_p, or F.dropout of the weights when they are returned): a TorchFunctionMode
# is off while its handler runs, and turning it on again there would hand it the same call again. So while one runs,
# the torch.nn.functional names its body calls (_DRAWN_INSIDE) go to the mode (_composite).
_COMPOSITES = (F.multi_head_attention_forward,)
_DRAWN_INSIDE = ("dropout", "scaled_dot_product_attention")


def _composite(mode: TorchFunctionMode, func: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    originals = {name: getattr(F, name) for name in _DRAWN_INSIDE}

    def routed(original: Callable) -> Callable:
        return lambda *a, **k: mode.__torch_function__(original, (), a, k)

    for name, original in originals.items():
        setattr(F, name, routed(original))
    try:
        return func(*args, **kwargs)
    finally:
        for name, original in originals.items():
            setattr(F, name, original)


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

    # -- the distributions, each from one call site's bits ------------------------------------------------------
    def uniform(self, shape: Sequence[int], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[0, 1) in float32, with as many significant bits as ``dtype`` holds (24 at most)."""
        return _uniform(self._bits(shape, device)[0], _DIGITS.get(dtype, 24) if dtype is not None else 24)

    def open_uniform(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return _open_uniform(self._bits(shape, device)[0])

    def normal(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """Box-Muller on the two words of each counter."""
        a, b = self._bits(shape, device)
        u1 = 1.0 - _uniform(a)                 # (0, 1]: log is finite
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * _uniform(b))

    def exponential(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """Exponential(1) by inversion, -log(u) with u in (0, 1): never 0 (as torch's ``exponential_``)."""
        return -torch.log(self.open_uniform(shape, device))

    def integers(self, what: str, shape: Sequence[int], device: torch.device, low: int, high: int) -> torch.Tensor:
        """int32, uniform on [low, high): low + (the top 31 bits mod (high - low)). The span is at most 2^31 and the
        values are int32's (int64 is int32 on JAX); the modulo's bias is below (high - low) / 2^31."""
        low, high = int(low), int(high)
        if low >= high:
            raise ProgramError(f"{what} expects 'from' to be less than 'to', but got from={low} >= to={high}")
        if low < _INT32[0] or high > _INT32[1] or high - low > 1 << 31:
            raise _refuse(f"{what} over [{low}, {high})", ": portable integers span at most 2^31 values within "
                          "int32's range (JAX runs without 64-bit integers)")
        top = _shr(self._bits(shape, device)[0], 1)             # [0, 2^31)
        span = high - low
        drawn = top if span == 1 << 31 else top % span
        return drawn + low if low else drawn

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
        if func in _COMPOSITES:
            return _composite(self, func, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is None:
            if func in _REFUSED and (func not in _TRAINING_ONLY or _trains(args, kwargs)):
                raise _refuse(_REFUSED[func])
            return func(*args, **kwargs)
        return handler(self, *args, **kwargs)




# The factories that take no tensor are not in torch.overrides.get_overridable_functions(), so Dynamo (inductor,
# xla's openxla mode) does not route them to a TorchFunctionMode, as eager torch does. Around a compiled loss call
# (:func:`factories`) they are replaced by forwarders to the active generator (_ACTIVE), which Dynamo traces as
# Python; outside a portable loss the forwarders call the original. The replacement itself is a patch of torch
# (xbridge/torch/patches.py). The ``_like`` factories take a tensor and reached the mode under Dynamo up to torch
# 2.9; torch 2.14's Dynamo traces ``torch.randn_like`` past it (inductor's portable losses then drew torch's own
# numbers: measured on tests/fixtures/stochastic.py, 4e-4 from eager's at step 0), so they are forwarded too.
_ACTIVE: list[PortableRandom] = []
_ORIGINAL = {f.__name__: f for f in (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
                                     torch.rand_like, torch.randn_like, torch.randint_like)}


def _a_compiler_calls() -> bool:
    """Whether a compiler's own code calls the factory while it compiles a loss, not the loss: Inductor's pattern
    matcher traces ``torch.randperm`` (fx_passes/misc_patterns.py) on first use, inside the loss's compile, with a
    portable loss active. Dynamo tracing the loss reads ``is_dynamo_compiling()`` as True (in real execution it is
    False) and never traces the check; run for real, it is a compiler's call while Dynamo's compile context is open
    (a graph break's eager code runs outside it) or while make_fx traces. (``is_compiling()`` served as the first
    test up to torch 2.9; torch 2.14 holds it True in real execution for the whole compile, pattern matcher
    included, and the matcher's fake tensors reached the portable generator.)"""
    if torch.compiler.is_dynamo_compiling():
        return False
    from torch._guards import CompileContext
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return CompileContext.try_get() is not None or get_proxy_mode() is not None


def _forwarder(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    handler = _HANDLERS[original]

    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not _ACTIVE or _a_compiler_calls():
            return original(*args, **kwargs)
        return handler(_ACTIVE[-1], *args, **kwargs)

    factory.__name__ = factory.__qualname__ = f"portable_{original.__name__}"
    return factory


_FORWARDERS = {name: _forwarder(original) for name, original in _ORIGINAL.items()}


def _inlined(function: Callable) -> Callable:
    """A copy of a torch function (its code and globals): Dynamo keeps ``F.multi_head_attention_forward`` whole in
    the graph, where AOT autograd later traces it with torch's own dropout; a copy is not the object Dynamo knows, so
    Dynamo traces its body, whose dropout and attention are then the forwarders below."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    return copy


# Under a compiler nn.MultiheadAttention's attention dropout would be torch's: its function is traced as its body, and
# the functions that body draws in (_DRAWN_INSIDE) go to the generator, as the mode sends them in eager.
_FUNCTIONAL = {**{name: _forwarder(getattr(F, name)) for name in _DRAWN_INSIDE},
               "multi_head_attention_forward": _inlined(F.multi_head_attention_forward)}


def factories() -> contextlib.AbstractContextManager[None]:
    """``torch.rand``, ``randn``, ``randint``, ``randperm``, ``normal`` and the ``_like`` factories, and
    ``F.dropout`` and ``F.scaled_dot_product_attention``, forwarded to the portable generator while a (compiled) loss
    runs, and put back after (:func:`xbridge.torch.patches.replaced_factories`)."""
    return replaced_factories(_FORWARDERS, _FUNCTIONAL)


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
        self.carried: list[bool] = []       # per draw: --rng portable draws it (False: refuses it)
        self.inside = 0                     # >0 while a draw --rng portable carries runs (its operators are the
                                            # sampler's there, not these: op_census.OpUse.drawn)

    def __torch_function__(self, func: Callable, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _COMPOSITES:
            return _composite(self, func, args, kwargs)
        name = None
        if func in _DROPOUTS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            name = _DROPOUTS[func] if training and p > 0 else None
        elif func is F.scaled_dot_product_attention:
            p = args[5] if len(args) > 5 else kwargs.get("dropout_p", 0.0)
            name = "scaled_dot_product_attention(dropout_p)" if p > 0 else None
        elif func in _HANDLERS or (func in _REFUSED and (func not in _TRAINING_ONLY or _trains(args, kwargs))):
            name = getattr(func, "__name__", str(func))
        if name is None:
            return func(*args, **kwargs)
        self.found.append((self.where[-1] if self.where else "(loss)", name))
        self.carried.append(func not in _REFUSED)
        self.inside += self.carried[-1]
        try:
            return func(*args, **kwargs)
        finally:
            self.inside -= self.carried[-1]


def random_draws(program: Any, batch: dict[str, Any]) -> list[tuple[str, str]]:
    """(module, op) of every random draw one training forward of ``program`` makes, in execution order: the model
    built on the meta device and the loss run on a meta ``batch`` (shapes only, no arithmetic)."""
    return [(module, op) for module, op, _ in random_draw_report(program, batch)]


def random_draw_report(program: Any, batch: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """:func:`random_draws`, each with whether ``--rng portable`` draws it (False: it refuses it)."""
    from .weights import meta_model

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
    return [(module, op, carried) for (module, op), carried in zip(recorder.found, recorder.carried, strict=True)]


def draw_recorder(where: list[str]) -> _Recorder:
    """A mode that notes each random draw of what runs inside it with ``where[-1]`` (the module running), as
    :func:`random_draw_report` does: ``.found`` (module, op) and ``.carried`` (--rng portable draws it)."""
    return _Recorder(where)


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
