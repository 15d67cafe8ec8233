"""The torch random functions portable randomness replaces, each drawn from :class:`PortableRandom`'s bits
(xbridge/torch/portable_rng.py lists them with their formulas), and the ones it refuses."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from xbridge.errors import ProgramError

from .threefry import _i32

if TYPE_CHECKING:
    from .portable_rng import PortableRandom


def _trains(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """rrelu's ``training`` (its fourth argument, default False): random only when training."""
    return bool(args[3] if len(args) > 3 else kwargs.get("training", False))


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


# torch's own: while a compiled loss runs, F.scaled_dot_product_attention is xbridge's forwarder to _sdpa itself
# (portable_rng.factories), which a call without dropout must not reach again
_TORCH_SDPA = F.scaled_dot_product_attention


def _sdpa(mode: PortableRandom, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    if dropout_p == 0.0:
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                           enable_gqa=enable_gqa)
    return mode.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)


def _where(mode: PortableRandom, device: Any) -> torch.device:
    return torch.device(device) if device is not None else mode.rows.device


def _creation(sample: str) -> Callable[..., torch.Tensor]:
    def run(mode: PortableRandom, *size: Any, generator: Any = None, dtype: torch.dtype | None = None,
            device: Any = None, requires_grad: bool = False, **_: Any) -> torch.Tensor:
        dtype = dtype or torch.get_default_dtype()
        shape, where = _size(size), _where(mode, device)
        out = mode.uniform(shape, where, dtype) if sample == "uniform" else mode.normal(shape, where)
        return out.to(dtype).requires_grad_(requires_grad)
    return run


def _like(sample: str) -> Callable[..., torch.Tensor]:
    def run(mode: PortableRandom, input: torch.Tensor, *, dtype: torch.dtype | None = None, device: Any = None,
            requires_grad: bool = False, **_: Any) -> torch.Tensor:
        dtype = dtype or input.dtype
        where = torch.device(device) if device is not None else input.device
        out = mode.uniform(input.shape, where, dtype) if sample == "uniform" else mode.normal(input.shape, where)
        return out.to(dtype).requires_grad_(requires_grad)
    return run


def _bernoulli(mode: PortableRandom, input: torch.Tensor, p: float | None = None, *, generator: Any = None,
               **_: Any) -> torch.Tensor:
    """1 where u < p (u uniform on [0, 1)); p is ``input`` itself when not given."""
    probability = input if p is None else torch.full_like(input, p)
    return (mode.uniform(input.shape, input.device) < probability.float()).to(input.dtype)


def _bounds(what: str, args: Sequence[Any], low: int, high: int | None, low_name: str = "low",
            high_name: str = "high", kwargs: dict[str, Any] | None = None) -> tuple[int, int | None]:
    """(low, high) of ``f(high)`` / ``f(low, high)``, positional or by keyword."""
    kwargs = kwargs or {}
    if len(args) == 1 and high_name not in kwargs:
        low, high = kwargs.get(low_name, low), args[0]
    elif len(args) >= 2:
        low, high = args[0], args[1]
    else:
        low = args[0] if args else kwargs.get(low_name, low)
        high = kwargs.get(high_name, high)
    return int(low), None if high is None else int(high)


def _randint(mode: PortableRandom, *args: Any, generator: Any = None, dtype: torch.dtype | None = None,
             device: Any = None, requires_grad: bool = False, size: Any = None, **kwargs: Any) -> torch.Tensor:
    """randint(high, size) or randint(low, high, size): low + (31 random bits mod (high - low))."""
    if size is None:
        args, size = args[:-1], args[-1]
    low, high = _bounds("torch.randint", args, 0, None, kwargs=kwargs)
    assert high is not None
    out = mode.integers("torch.randint", _size((size,)), _where(mode, device), low, high)
    return out.to(dtype or torch.int64)


def _randint_like(mode: PortableRandom, input: torch.Tensor, *args: Any, dtype: torch.dtype | None = None,
                  device: Any = None, **kwargs: Any) -> torch.Tensor:
    low, high = _bounds("torch.randint_like", args, 0, None, kwargs=kwargs)
    assert high is not None
    where = torch.device(device) if device is not None else input.device
    return mode.integers("torch.randint_like", input.shape, where, low, high).to(dtype or input.dtype)


# -- the in-place samplers: the sample is drawn for the tensor's shape and copied into it (``copy_``, which every
# stack traces: Dynamo, torch_xla's lazy tensors, torchax), which is then returned, as torch does -------------------
def _fill(draw: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(mode: PortableRandom, self: torch.Tensor, *args: Any, generator: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.copy_(draw(mode, self, *args, **kwargs))
    run.__name__ = draw.__name__
    return run


def _check(ok: bool, message: str) -> None:
    """torch's own check of a sampler's arguments (the same words), made before anything is drawn."""
    if not ok:
        raise ProgramError(message)


def _floating(what: str, self: torch.Tensor) -> None:
    _check(self.dtype.is_floating_point, f"{what} draws from a continuous distribution: the tensor must be floating "
           f"point, but it is {self.dtype}")


@_fill
def _bernoulli_(mode: PortableRandom, self: torch.Tensor, p: float | torch.Tensor = 0.5) -> torch.Tensor:
    """1 where u < p: p a float or a tensor of probabilities broadcast to the tensor's shape."""
    if not isinstance(p, torch.Tensor):
        _check(0.0 <= p <= 1.0, f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    probability = p.float() if isinstance(p, torch.Tensor) else p
    return mode.uniform(self.shape, self.device) < probability


@_fill
def _uniform_(mode: PortableRandom, self: torch.Tensor, a: float = 0.0, b: float = 1.0, *,
              to: float | None = None, **kwargs: Any) -> torch.Tensor:
    """from + (to - from) u."""
    low, high = kwargs.get("from", a), b if to is None else to
    _floating("uniform_", self)
    _check(low <= high, f"uniform_ expects to return a [from, to) range, but found from={low} > to={high}")
    return low + (high - low) * mode.uniform(self.shape, self.device)


@_fill
def _normal_(mode: PortableRandom, self: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """mean + std z, z standard normal (Box-Muller)."""
    _floating("normal_", self)
    _check(std >= 0.0, f"normal expects std >= 0.0, but found std {std}")
    return mean + std * mode.normal(self.shape, self.device)


@_fill
def _exponential_(mode: PortableRandom, self: torch.Tensor, lambd: float = 1.0) -> torch.Tensor:
    """-log(u) / lambd, u in (0, 1)."""
    _floating("exponential_", self)
    _check(lambd > 0.0, f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return mode.exponential(self.shape, self.device) / lambd


@_fill
def _geometric_(mode: PortableRandom, self: torch.Tensor, p: float) -> torch.Tensor:
    """ceil(log(u) / log(1 - p)), u in (0, 1): the number of the first successful trial, 1, 2, ..."""
    _check(0.0 < p < 1.0, f"geometric_ expects p to be in (0, 1), but got p={p}")
    return torch.ceil(torch.log(mode.open_uniform(self.shape, self.device)) * (1.0 / math.log1p(-p)))


@_fill
def _log_normal_(mode: PortableRandom, self: torch.Tensor, mean: float = 1.0, std: float = 2.0) -> torch.Tensor:
    """exp(mean + std z): mean and std are the underlying normal's (torch's defaults 1 and 2)."""
    _floating("log_normal_", self)
    _check(std > 0.0, f"log_normal_ expects std > 0.0, but found std={std}")
    return torch.exp(mean + std * mode.normal(self.shape, self.device))


@_fill
def _cauchy_(mode: PortableRandom, self: torch.Tensor, median: float = 0.0, sigma: float = 1.0) -> torch.Tensor:
    """median + sigma tan(pi (u - 1/2)), u in (0, 1)."""
    _floating("cauchy_", self)
    _check(sigma > 0.0, f"cauchy_ expects sigma > 0.0, but found sigma={sigma}")
    return median + sigma * torch.tan(math.pi * (mode.open_uniform(self.shape, self.device) - 0.5))


def _dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    """random_()'s range for the dtype, [low, high): [0, 2^digits] for a float (every integer in it is exact), [0, max]
    for an integer type, {0, 1} for bool."""
    if dtype == torch.bool:
        return 0, 2
    if dtype.is_floating_point:
        return 0, (1 << (round(-math.log2(torch.finfo(dtype).eps)) + 1)) + 1     # 2^24 + 1 for float32
    return 0, int(torch.iinfo(dtype).max) + 1


@_fill
def _random_(mode: PortableRandom, self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """random_() / random_(to) / random_(from, to): uniform integers on [from, to - 1]
    (:meth:`PortableRandom.integers`); without ``to``, up to the dtype's largest (``[0, 2^mantissa]`` for a float)."""
    low, high = _bounds("random_", args, 0, None, "from", "to", kwargs)
    if high is None:
        high = _dtype_range(self.dtype)[1]
    what = f"Tensor.random_ on {str(self.dtype).removeprefix('torch.')}"
    return mode.integers(what, self.shape, self.device, low, high)


def _multinomial(mode: PortableRandom, input: torch.Tensor, num_samples: int, replacement: bool = False, *,
                 generator: Any = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Indices drawn by weight along the last dimension (1 or 2 dimensions; weights need not sum to 1), int64.
    With replacement: inverse CDF, the number of categories whose cumulative weight is <= u * total. Without:
    Gumbel-top-k, the k smallest log(E) - log(w) (E exponential, so -log(E) is Gumbel), which orders the picks as
    successive draws without replacement would; zero weights come last, in index order (as torch's)."""
    n = input.shape[-1]
    weights = input.float()
    if replacement:
        cdf = torch.cumsum(weights, dim=-1)
        target = mode.uniform((*input.shape[:-1], num_samples), input.device) * cdf[..., -1:]
        drawn = (cdf.unsqueeze(-2) <= target.unsqueeze(-1)).sum(dim=-1).clamp(max=n - 1)
    else:
        _check(num_samples <= n, "cannot sample n_sample > prob_dist.size(-1) samples without replacement")
        keys = torch.log(mode.exponential(input.shape, input.device)) - torch.log(weights)
        unweighted = 1000.0 + torch.arange(n, dtype=torch.float32, device=input.device)
        keys = torch.where(weights > 0, keys, unweighted)
        drawn = torch.topk(keys, num_samples, dim=-1, largest=False, sorted=True).indices
    drawn = drawn.to(torch.int64)
    return drawn if out is None else out.copy_(drawn)


def _randperm(mode: PortableRandom, n: int, *, generator: Any = None, out: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, device: Any = None, requires_grad: bool = False,
              **_: Any) -> torch.Tensor:
    """argsort of one random int32 key per position; the key's low ceil(log2 n) bits are the position itself, so
    the keys are distinct and the order is the same on every stack whatever its sort's tie rule (a tie of the
    32 - ceil(log2 n) random bits keeps the two positions in order)."""
    n = int(n)
    _check(0 <= n <= 1 << 31, f"randperm: n must be non-negative and at most 2^31, got {n}")
    where = _where(mode, device)
    low = max(1, (n - 1).bit_length())
    index = torch.arange(n, dtype=torch.int32, device=where)
    keys = (mode._bits((n,), where)[0] & _i32(~((1 << low) - 1))) | index
    drawn = torch.argsort(keys).to(dtype or torch.int64).requires_grad_(requires_grad)
    return drawn if out is None else out.copy_(drawn)


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch's promotion of two dtypes, in Python (torchax cannot lower ``torch.promote_types``)."""
    if a == b or (a.is_floating_point and not b.is_floating_point):
        return a
    if b.is_floating_point and not a.is_floating_point:
        return b
    if {a, b} == {torch.float16, torch.bfloat16}:
        return torch.float32
    return a if a.itemsize >= b.itemsize else b


def _normal(mode: PortableRandom, mean: Any = 0.0, std: Any = 1.0, size: Any = None, *, generator: Any = None,
            out: torch.Tensor | None = None, dtype: torch.dtype | None = None, device: Any = None,
            requires_grad: bool = False, **_: Any) -> torch.Tensor:
    """torch.normal's overloads: (Tensor, Tensor), (Tensor, float), (float, Tensor) broadcast together, and
    (float, float, size): mean + std z. No gradient reaches a tensor mean or std (torch's is zero there)."""
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if not tensors:
        _check(std >= 0.0, f"normal expects std >= 0.0, but found std {std}")
        dtype = dtype or torch.get_default_dtype()
        z = mode.normal(_size((size,)), _where(mode, device)).to(dtype)
        drawn = (mean + std * z).requires_grad_(requires_grad)
    else:
        kind = tensors[0].dtype if len(tensors) == 1 else _promote(tensors[0].dtype, tensors[1].dtype)
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        z = mode.normal(shape, tensors[0].device).to(kind)
        mean, std = (t.detach() if isinstance(t, torch.Tensor) else t for t in (mean, std))
        drawn = mean + std * z
    return drawn if out is None else out.copy_(drawn)


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
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.Tensor.uniform_: _uniform_,
    torch.Tensor.normal_: _normal_,
    torch.Tensor.exponential_: _exponential_,
    torch.Tensor.geometric_: _geometric_,
    torch.Tensor.log_normal_: _log_normal_,
    torch.Tensor.cauchy_: _cauchy_,
    torch.Tensor.random_: _random_,
    torch.multinomial: _multinomial,
    torch.Tensor.multinomial: _multinomial,
    torch.randperm: _randperm,
    torch.normal: _normal,
}
_REFUSED: dict[Callable, str] = {
    F.alpha_dropout: "F.alpha_dropout", F.feature_alpha_dropout: "F.feature_alpha_dropout",
    F.rrelu: "F.rrelu (training)", torch.rrelu: "torch.rrelu", torch.poisson: "torch.poisson",
    torch.binomial: "torch.binomial", torch._standard_gamma: "torch._standard_gamma (Gamma, Beta, Dirichlet)",
    torch._sample_dirichlet: "torch._sample_dirichlet",
}
_TRAINING_ONLY = (F.rrelu, torch.rrelu)
