"""The jitted steps of the JAX executable: the train step (gradients over the micro-batches, then the update: unscale,
clip, optimizer, loss scaling), as one GSPMD ``jax.jit`` or written per device with ``jax.shard_map``; and the loss in
eval mode, jitted on its own."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xbridge.ir.sharding import spec_axes
from xbridge.torch.train import eval_mode

from . import optimizers

if TYPE_CHECKING:
    from .executable import JaxExecutable


def nonzero(count: jax.Array) -> jax.Array:
    """An ``xb.LossSum`` count to divide by: 1 stands for 0 (a batch without items, whose total is 0)."""
    return jnp.where(count > 0, count, 1.0)


def micro_grads(ex: JaxExecutable, params: Any, buffers: Any, batch: Any, scale: Any, divisor: float,
                gather: Callable[[Any], Any], count_everywhere: Callable[[jax.Array], jax.Array],
                key: jax.Array) -> tuple[Any, jax.Array, Any, jax.Array]:
    """Gradient (summed over micro-batches, each loss divided by accum*divisor, times the loss scale), the
    mean unscaled loss of this device's batch, and the buffers after the last micro-batch's forward (each
    micro-batch's forward sees the buffers the previous one left, as in eager).

    A loss returning ``xb.LossSum`` is differentiated as its total / divisor; the summed gradient and the summed
    total are then multiplied by ``divisor / count_everywhere(count)``: the count summed over this device's
    micro-batches, then over every device (a device holding the same rows as another counts them again, as its
    total does). Once the caller sums the gradients over the devices (and averages the loss over them: the
    ``divisor``), both are the global total over the global count. The last result: that count (NaN for a mean),
    which the run loop checks. ``key``: the step's ``--rng native`` key, folded with each micro-batch's index."""
    accum = ex.program.step.grad_accum

    def loss_fn(p: Any, mb: Any, bufs: Any, k: jax.Array) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
        loss, count, updated = ex.loss_of(gather(p), bufs, mb, k)
        scaled = loss / (accum * divisor) if count is None else loss / divisor
        return (scaled * scale if scale is not None else scaled), (loss, count, updated)

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(*args: Any) -> Any:
        # a complex parameter's gradient as torch gives it (d/dre + i d/dim): JAX's is its conjugate
        out, grads = value_and_grad(*args)
        return out, jax.tree.map(lambda g: jnp.conj(g) if jnp.iscomplexobj(g) else g, grads)
    changed = ex.changed_in_forward     # parameters the forward changes in place: each micro-batch sees the last's
    if accum == 1:
        (_, (loss, count, updated)), grads = grad_fn(params, batch, buffers, key)
    else:
        micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)
        summed: list[bool] = []     # filled while the body is traced: did the loss return xb.LossSum?

        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            g_acc, l_acc, c_acc, bufs, own = carry
            mb, index = xs
            (_, (loss, count, bufs)), g = grad_fn({**params, **own}, mb, bufs, jax.random.fold_in(key, index))
            own = {n: bufs.pop(n) for n in changed}
            summed.append(count is not None)
            # a mean: the mean over the micro-batches; a LossSum: the totals and the counts summed
            l_acc = l_acc + loss / accum if count is None else l_acc + loss
            c_acc = c_acc + count if count is not None else c_acc
            return (jax.tree.map(jnp.add, g_acc, g), l_acc, c_acc, bufs, own), None

        init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32),
                buffers, {n: params[n] for n in changed})
        (grads, loss, count, updated, own), _ = jax.lax.scan(body, init, (micro, jnp.arange(accum)))
        updated = {**updated, **own}
        count = count if summed[-1] else None
    items = jnp.full((), jnp.nan, jnp.float32)
    if count is not None:
        items = count_everywhere(count).astype(jnp.float32)
        factor = divisor / nonzero(items)
        grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
        loss = loss * factor
    return grads, loss, updated, items


def apply_update(ex: JaxExecutable, state: dict[str, Any], grads: Any, loss: jax.Array, buffers: Any,
                 reduce_sum: Callable[[str, jax.Array], jax.Array],
                 count: jax.Array) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Unscale, clip by global norm (torch's formula), optimizer update, loss-scale bookkeeping; the buffers
    the forward updated are kept. ``reduce_sum(name, x)`` totals a per-parameter scalar over the devices
    holding that parameter's shards."""
    spec = ex.program.optimizer
    # a parameter the forward changed in place (under torch.no_grad) is updated from its changed value, as torch's is
    params = {**state["params"], **{n: v for n, v in buffers.items() if n in state["params"]}}
    new = dict(state, buffers={n: v for n, v in buffers.items() if n not in state["params"]})
    if ex.scaling:
        inv = 1.0 / state["scaler"].scale
        grads = jax.tree.map(lambda g: (g * inv).astype(g.dtype), grads)
        bad = jnp.sum(jnp.stack([reduce_sum(n, jnp.sum(~jnp.isfinite(g)).astype(jnp.float32))
                                 for n, g in grads.items()]))
        finite = bad == 0
    # per parameter, how many gradient entries are NaN/Inf: names the culprit when the loss goes non-finite
    # (a scanned layers' group: one count per layer; in the order of ``ex.bad_grad_names``)
    bad_grads = jnp.concatenate([reduce_sum(k, ex.stacks.nonfinite_counts(k, grads[k])) for k in ex.param_keys])
    # the global L2 norm, unscaled and before clipping (what torch's clip_grad_norm_ returns)
    norm = jnp.sqrt(sum((reduce_sum(n, jnp.sum(jnp.square(jnp.abs(g).astype(jnp.float32)))) for n, g in grads.items()),
                        jnp.zeros((), jnp.float32)))
    clip = ex.program.step.clip_grad_norm
    if clip is not None:
        coef = jnp.minimum(clip / (norm + 1e-6), 1.0)
        grads = jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)
    lr = optimizers.learning_rate(spec, state["step"])
    trained = {n: params[n] for n in ex.trained_keys}   # as torch.optim: a parameter without gradient is skipped
    direction, opt = ex.tx.update({n: grads[n] for n in ex.trained_keys}, state["opt"], trained)
    updated = {**params, **optax.apply_updates(trained, jax.tree.map(lambda u: -lr * u, direction))}
    if ex.scaling:
        new["params"] = jax.tree.map(lambda a, b: jnp.where(finite, a, b), updated, params)
        new["opt"] = jax.tree.map(lambda a, b: jnp.where(finite, a, b), opt, state["opt"])
        new["scaler"] = optimizers.scaler_update(state["scaler"], finite)
    else:
        new["params"], new["opt"] = updated, opt
    new["step"] = state["step"] + 1
    return new, {"loss": loss, "lr": lr, "bad_grads": bad_grads, "grad_norm": norm, "count": count}


def train_step(ex: JaxExecutable) -> Any:   # a jitted function (jax.stages.Wrapped: called, and .lower() for --dump)
    """The jitted train step: one ``jax.jit`` of the whole step, with the state donated; in ``gspmd`` mode the
    partitioner splits it, in ``shard_map`` mode it is written per device with explicit collectives."""
    scale_of = (lambda s: s["scaler"].scale) if ex.scaling else (lambda s: None)
    metric_specs = {"loss": P(), "lr": P(), "bad_grads": P(), "grad_norm": P(), "count": P()}
    metrics = jax.tree.map(lambda s: NamedSharding(ex.mesh, s), metric_specs)

    def jit(fn: Callable) -> Callable:
        # explicit layouts in and out keep the state where the plan put it, step after step
        return jax.jit(fn, in_shardings=(ex.state_shardings, ex.batch_sharding),
                       out_shardings=(ex.state_shardings, metrics), donate_argnums=(0,))

    if ex.mode == "gspmd":
        def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
            ex.traces += 1
            key = jax.random.fold_in(ex.native_key, state["step"])     # --rng native: a key per step
            grads, loss, buffers, count = micro_grads(ex, state["params"], state["buffers"], batch, scale_of(state),
                                                      1.0, lambda p: p, lambda c: c, key)
            return apply_update(ex, state, grads, loss, buffers, lambda name, x: x, count)

        return jit(step)

    axes = tuple(ex.mesh.axis_names)
    n_devices = math.prod(ex.plan.axis_sizes.values())
    sharded_axes = {n: tuple(spec_axes(s)) for n, s in ex.specs.items()}

    def gather(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """All-gather every sharded dimension: the torch model sees full parameters."""
        full = {}
        for name, value in params.items():
            for dim, entry in enumerate(ex.specs[name]):
                if entry is not None:
                    value = jax.lax.all_gather(value, entry, axis=dim, tiled=True)
            full[name] = value
        return full

    def reduce_sum(name: str, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, sharded_axes[name]) if sharded_axes[name] else x

    def per_device(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
        ex.traces += 1
        # Each device differentiates its local mean loss / n_devices. The transpose of all_gather sums the
        # gathered axes (psum_scatter); summing the remaining axes gives every device the global gradient.
        # --rng native: a key per step and device (each device draws for its own rows)
        key = jax.random.fold_in(jax.random.fold_in(ex.native_key, state["step"]), jax.lax.axis_index(axes))
        grads, loss, buffers, count = micro_grads(ex, state["params"], state["buffers"], batch, scale_of(state),
                                                  float(n_devices), gather, lambda c: jax.lax.psum(c, axes), key)
        grads = {n: (jax.lax.psum(g, rest) if (rest := tuple(a for a in axes if a not in sharded_axes[n])) else g)
                 for n, g in grads.items()}
        loss = jax.lax.psum(loss, axes) / n_devices
        # each device's forward saw its own rows (as torch DDP without SyncBatchNorm): floating buffers are
        # averaged over the devices so that every device keeps the same value; counters agree already
        buffers = {n: (jax.lax.pmean(b, axes) if jnp.issubdtype(b.dtype, jnp.floating) else b)
                   for n, b in buffers.items()}
        return apply_update(ex, state, grads, loss, buffers, reduce_sum, count)

    batch_specs = ex.batch_spec
    mapped = jax.shard_map(per_device, mesh=ex.mesh, in_specs=(ex.state_specs, batch_specs),
                           out_specs=(ex.state_specs, metric_specs), check_vma=False)
    return jit(mapped)


def eval_step(ex: JaxExecutable) -> Any:
    """The loss in eval mode (traced once with every module's ``training`` off), jitted on its own."""
    model = ex.lowered.module._model

    def loss_in_eval_mode(params: Any, buffers: Any, b: Any) -> jax.Array:
        with eval_mode(model):
            loss, count, _ = ex.loss_of(params, buffers, b)
            return loss if count is None else loss / nonzero(count)

    return jax.jit(loss_in_eval_mode, out_shardings=ex.replicated)
