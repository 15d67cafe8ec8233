"""optax transformations with torch.optim's exact semantics, and torch.amp.GradScaler's dynamic loss scaling.

A complex parameter is optimised as torch.optim does it, as its pairs of (real, imaginary) numbers
(``torch.view_as_real``): :func:`in_real_pairs` gives the transformation those pairs (its state holds them, a
trailing axis of 2) and the checkpoint names hold them as complex arrays again, as torch stores them.

The learning rate is applied outside the transformation (``updates * -lr``) with lr computed from the step count
we keep ourselves: torch advances its LambdaLR on every step, even one that GradScaler skips, while the optimizer's
own count (Adam's bias correction) only advances on applied steps. Keeping the two counts apart matches both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xbridge.ir.optim import SGD, AdamW


class TorchMomentumState(NamedTuple):
    buf: Any
    started: jax.typing.ArrayLike     # bool: has a first step set the buffers?


def torch_sgd_momentum(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    """torch.optim.SGD's momentum: the first buffer is the gradient itself, then
    ``buf = momentum*buf + (1-dampening)*g``; Nesterov uses ``g + momentum*buf``. (optax.trace starts from zeros
    and has no dampening, so it differs whenever dampening != 0.)"""

    def init(params: Any) -> TorchMomentumState:
        return TorchMomentumState(jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.bool_))

    def update(grads: Any, state: TorchMomentumState, params: Any = None) -> tuple[Any, TorchMomentumState]:
        buf = jax.tree.map(
            lambda b, g: jnp.where(state.started, momentum * b + (1.0 - dampening) * g, g).astype(b.dtype),
            state.buf, grads)
        out = jax.tree.map(lambda g, b: g + momentum * b, grads, buf) if nesterov else buf
        return out, TorchMomentumState(buf, jnp.ones([], jnp.bool_))

    return optax.GradientTransformation(init, update)


def direction(spec: SGD | AdamW) -> optax.GradientTransformation:
    """The update direction before ``* -lr``: every hyperparameter from the spec, nothing from optax defaults."""
    if isinstance(spec, AdamW):
        # optax.adamw = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate); the last is ours.
        return in_real_pairs(optax.chain(
            optax.scale_by_adam(b1=spec.betas[0], b2=spec.betas[1], eps=spec.eps, eps_root=0.0, nesterov=False),
            optax.add_decayed_weights(spec.weight_decay),
        ))
    if isinstance(spec, SGD):
        parts = [optax.add_decayed_weights(spec.weight_decay)] if spec.weight_decay else []  # coupled, as torch
        if spec.momentum:
            parts.append(torch_sgd_momentum(spec.momentum, spec.dampening, spec.nesterov))
        return in_real_pairs(optax.chain(*parts) if parts else optax.identity())
    raise TypeError(f"unsupported optimizer spec {spec!r}")


def pairs(x: Any) -> Any:
    """A complex array as its (real, imaginary) pairs on a trailing axis (torch.view_as_real); others unchanged."""
    return jnp.stack([x.real, x.imag], axis=-1) if jnp.iscomplexobj(x) else x


def joined(x: Any) -> Any:
    """The complex array of :func:`pairs`."""
    return jax.lax.complex(x[..., 0], x[..., 1])


def in_real_pairs(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on every complex parameter's (real, imaginary) pairs, as torch.optim treats a complex parameter:
    AdamW's second moment is then the mean square of each part, not of the modulus (optax's own choice)."""

    def init(params: Any) -> Any:
        return tx.init(jax.tree.map(pairs, params))

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        out, state = tx.update(jax.tree.map(pairs, grads), state,
                               None if params is None else jax.tree.map(pairs, params))
        return jax.tree.map(lambda u, g: joined(u) if jnp.iscomplexobj(g) else u, out, grads), state

    return optax.GradientTransformation(init, update)


def learning_rate(spec: SGD | AdamW, step: jax.Array) -> jax.Array:
    return jnp.float32(spec.lr) * spec.schedule.factor_array(step.astype(jnp.float32), jnp).astype(jnp.float32)


class ScalerState(NamedTuple):
    scale: jax.typing.ArrayLike           # float32 (on the host in checkpoints, on the device in the step)
    growth_tracker: jax.typing.ArrayLike  # int32


# torch.amp.GradScaler defaults
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000


def scaler_init() -> ScalerState:
    return ScalerState(jnp.float32(INIT_SCALE), jnp.int32(0))


def scaler_update(state: ScalerState, finite: jax.Array) -> ScalerState:
    """GradScaler.update: back off and reset on overflow; grow after GROWTH_INTERVAL finite steps in a row."""
    tracker = jnp.where(finite, state.growth_tracker + 1, 0)
    grow = tracker >= GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, state.scale * GROWTH_FACTOR, state.scale), state.scale * BACKOFF_FACTOR)
    return ScalerState(scale.astype(jnp.float32), jnp.where(grow, 0, tracker).astype(jnp.int32))


# ---------------------------------------------------------------------- checkpoint names
# The optimizer state crosses backends under torch.optim's per-parameter keys (xbridge/checkpoint/format.py):
# AdamW ``step``/``exp_avg``/``exp_avg_sq``, SGD ``momentum_buffer`` (torch creates it on the first step).

def _parts(opt: Any) -> list[Any]:
    return list(opt) if isinstance(opt, tuple) and not hasattr(opt, "_fields") else [opt]


def _host(leaf: Any) -> Any:
    return np.asarray(leaf, dtype=np.complex64 if jnp.iscomplexobj(leaf) else np.float32)


def export_state(opt: Any, torch_names: dict[str, str], convert: Callable[[Any], Any] = _host,
                 complex_names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``optim/<eager name>/<key>`` -> ``convert(leaf)`` (default: a float32 host array, complex64 for a complex
    parameter's); ``torch_names`` maps each trained (canonical) name to its eager name; ``complex_names``: the
    complex parameters, whose state :func:`in_real_pairs` holds as pairs and torch as complex arrays."""
    def leaf(tree: Any, name: str) -> Any:
        return convert(joined(tree[name]) if name in complex_names else tree[name])

    out: dict[str, Any] = {}
    for part in _parts(opt):
        if isinstance(part, optax.ScaleByAdamState):
            for name, eager in torch_names.items():
                out[f"optim/{eager}/step"] = convert(part.count)
                out[f"optim/{eager}/exp_avg"] = leaf(part.mu, name)
                out[f"optim/{eager}/exp_avg_sq"] = leaf(part.nu, name)
        elif isinstance(part, TorchMomentumState) and bool(part.started):
            for name, eager in torch_names.items():
                out[f"optim/{eager}/momentum_buffer"] = leaf(part.buf, name)
    return out


class Cast:
    """A checkpoint tensor read slice by slice in ``dtype`` (what :func:`import_state`'s ``place`` receives)."""

    def __init__(self, source: Any, dtype: Any) -> None:
        self.source, self.dtype, self.shape = source, dtype, tuple(source.shape)

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.asarray(self.source[index]).astype(self.dtype)


class Pairs:
    """A complex checkpoint tensor read slice by slice as its (real, imaginary) pairs (:func:`pairs`)."""

    def __init__(self, source: Any) -> None:
        self.source, self.shape = source, (*source.shape, 2)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if index == (Ellipsis,):
            index = ()
        index = index + (slice(None),) * (len(self.shape) - len(index))
        value = np.asarray(self.source[index[:-1]])
        return np.stack([value.real, value.imag], axis=-1)[(..., index[-1])]


def _host_copy(value: Any, like: Any) -> Any:
    return np.asarray(value[...]).astype(like.dtype)


def import_state(opt: Any, state: dict[str, Any], torch_names: dict[str, str],
                 place: Callable[[Any, Any], Any] = _host_copy, complex_names: frozenset[str] = frozenset()) -> Any:
    """``opt`` (a freshly initialised state) with every entry the checkpoint holds; absent entries keep their
    initial value, which is what torch.optim starts a parameter's state from. ``place(value, like)`` makes the
    leaf ``like`` from the checkpoint's ``value`` (default: a host copy in ``like``'s dtype); a complex
    parameter's (``complex_names``) is read as its pairs."""
    names = {eager: name for name, eager in torch_names.items()}

    def load(eager: str, key: str, like: Any) -> Any:
        value = state.get(f"optim/{eager}/{key}")
        if value is not None and names[eager] in complex_names:
            value = Pairs(value)
        return like if value is None else place(value, like)

    parts = []
    for part in _parts(opt):
        if isinstance(part, optax.ScaleByAdamState):
            steps = {float(np.asarray(state[f"optim/{e}/step"])) for e in torch_names.values()
                     if f"optim/{e}/step" in state}
            count = part.count if not steps else np.asarray(max(steps), dtype=part.count.dtype)
            part = part._replace(count=count,
                                 mu={n: load(e, "exp_avg", part.mu[n]) for n, e in torch_names.items()},
                                 nu={n: load(e, "exp_avg_sq", part.nu[n]) for n, e in torch_names.items()})
        elif isinstance(part, TorchMomentumState):
            started = any(f"optim/{e}/momentum_buffer" in state for e in torch_names.values())
            part = TorchMomentumState({n: load(e, "momentum_buffer", part.buf[n]) for n, e in torch_names.items()},
                                      np.asarray(started))
        parts.append(part)
    return tuple(parts) if isinstance(opt, tuple) and not hasattr(opt, "_fields") else parts[0]
