"""The JAX executable: state placement from the plan, one jitted train step (GSPMD or shard_map), numpy I/O."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xbridge import hints
from xbridge.cache import cache_dir
from xbridge.contract import CompileCache, Probes, Profiling, Target, on_host
from xbridge.data import contract
from xbridge.data.contract import BatchCheck, checked_batch
from xbridge.errors import BackendUnavailable, LoweringError
from xbridge.ir.program import Program
from xbridge.ir.sharding import Spec, spec_axes
from xbridge.planner import ShardingPlan
from xbridge.run import processes
from xbridge.run.profile import STEP_MARK
from xbridge.run.rng import rng_rows
from xbridge.torch import remat as shared_remat
from xbridge.torch.train import build_model, eval_mode, tensor_to_numpy

from . import attention, checkpoint_shards, layer_scan, ops, optimizers, remat
from .layer_stacks import Stacks
from .lowering import LoweredLoss, matmul_precision, sharding_hint
from .state_io import JaxState

# JAX's own compile events, counted for every executable of this process (jax.monitoring has no unregister)
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace (torchax + jaxpr)",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower to StableHLO",
              "/jax/core/compile/backend_compile_duration": "XLA compile or cache load"}
_counts: dict[str, float] = {}


def _count_event(event: str, **kwargs: str | int) -> None:
    if event in _EVENTS:
        _counts[_EVENTS[event]] = _counts.get(_EVENTS[event], 0) + 1


def _count_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event in _DURATIONS:
        _counts[_DURATIONS[event]] = _counts.get(_DURATIONS[event], 0.0) + duration_secs


@functools.cache
def _listen_once() -> None:
    jax.monitoring.register_event_listener(_count_event)
    jax.monitoring.register_event_duration_secs_listener(_count_duration)


def _nonzero(count: jax.Array) -> jax.Array:
    """An ``xb.LossSum`` count to divide by: 1 stands for 0 (a batch without items, whose total is 0)."""
    return jnp.where(count > 0, count, 1.0)


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, on by default (JAX_COMPILATION_CACHE_DIR still wins)."""
    if not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]  # (flags are declared at run time)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir("jax")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def to_jax_dtype(array: np.ndarray, float_dtype: Any) -> np.ndarray:
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(float_dtype, copy=False)
    if array.dtype == np.int64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        if array.size and (array.max() > np.iinfo(np.int32).max or array.min() < np.iinfo(np.int32).min):
            raise ValueError("int64 values do not fit in int32 (JAX runs without x64)")
        return array.astype(np.int32)
    return array


class JaxExecutable(JaxState, Probes, Profiling):
    def __init__(self, program: Program, plan: ShardingPlan, target: Target, mode: str) -> None:
        self.program, self.plan, self.target, self.mode = program, plan, target, mode
        enable_compilation_cache()
        _listen_once()
        self._counts_start = dict(_counts)
        available = jax.devices(target.device)
        if len(available) < plan.devices:
            raise BackendUnavailable(f"target {target} has {len(available)} device(s), the plan needs {plan.devices}")
        sizes = plan.axis_sizes
        self.mesh = jax.sharding.Mesh(np.array(available[: plan.devices]).reshape(tuple(sizes.values())),
                                      tuple(sizes))
        self.replicated = NamedSharding(self.mesh, P())
        self.traces = 0
        self.warm_traces = 0
        self._eval: Any = None
        self.scaling = program.precision.loss_scale == "dynamic"
        self.tx = optimizers.direction(program.optimizer)
        self._bad_grads: jax.Array | None = None
        self.processes = jax.process_count()    # > 1: the mesh spans several processes (--processes)
        self._compiled = False
        self._local: tuple[BatchCheck, np.ndarray] | None = None

    # ------------------------------------------------------------------ state

    def init(self, weights: dict[str, np.ndarray]) -> None:
        program = self.program
        attention.check(program.step.attention, str(self.target), self.mesh.devices.flat[0].platform)
        # the module gives shapes, ties and the non-persistent buffers; the parameters and buffers are placed from
        # ``weights`` below, each device's slice read on its own (a sharded checkpoint is never read whole)
        model = build_model(program, None, torch.device("cpu"))
        shared_remat.apply(model, program, remat.checkpoint(program.step.remat))
        self.scanner = layer_scan.apply(model, program)    # after remat: each scanned layer runs as remat wrapped it
        ops.register()
        self.lowered = LoweredLoss(program, model)
        self.lowered.hint = (sharding_hint(self.mesh, self.plan.axis_sizes) if self.mode == "gspmd"
                             else hints.checker(self.plan.axis_sizes))
        self.names = list(weights)
        self.dtypes = {n: w.dtype for n, w in weights.items()}    # an int64 counter comes back int64, not int32
        float_dtype = jnp.dtype(program.precision.params)
        planned = {p.name: p.spec for p in self.plan.params}
        self.specs: dict[str, Spec] = {}
        for name in self.lowered.param_names:
            aliases = [n for n, c in self.lowered.canonical.items() if c == name]
            self.specs[name] = next((planned[n] for n in [name, *aliases] if n in planned), ())
        def cast(value: np.ndarray) -> np.ndarray:
            return to_jax_dtype(value, float_dtype)

        params = {n: checkpoint_shards.placed(weights[n], NamedSharding(self.mesh, P(*self.specs[n])), cast)
                  for n in self.lowered.param_names}
        # buffers (and frozen parameters, which torchax keeps with them) in the params dtype, bf16 too; a
        # non-persistent buffer (not in the state_dict) as the module built it
        buffers = {n: checkpoint_shards.placed(weights[n] if n in weights else tensor_to_numpy(b), self.replicated,
                                               cast)
                   for n, b in self.lowered.module.buffers.items()}
        self.trained = self._params_the_loss_uses(params, buffers, float_dtype)
        self.stacks = Stacks.of_scan(self.scanner, self.lowered.canonical, self.trained, self.specs, params)
        params = self.stacks.stack(params)
        for key in self.stacks.groups:
            self.specs[key] = self.stacks.spec_of(key, self.specs)
        self.trained_keys = self.stacks.keys(self.trained)
        self.param_keys = self.stacks.keys(self.lowered.param_names)
        self.bad_grad_names = [n for key in self.param_keys for n in self.stacks.names_of(key)]
        opt = self.tx.init({n: params[n] for n in self.trained_keys})
        state = {"params": params, "opt": opt, "buffers": buffers, "step": jnp.int32(0)}
        if self.scaling:
            state["scaler"] = optimizers.scaler_init()
        self.state_specs = self._state_specs(state)
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs,
                                            is_leaf=lambda x: isinstance(x, P))
        self.state = jax.device_put(state, self.state_shardings)
        batch_spec = P(*self.plan.batch)
        self.batch_sharding = NamedSharding(self.mesh, batch_spec)
        self.batch_spec = batch_spec
        self.jitted = self._build()

    def _params_the_loss_uses(self, params: dict[str, jax.Array], buffers: dict[str, jax.Array],
                              float_dtype: Any) -> list[str]:
        """The parameters the loss reads (in the traced loss of one micro-batch). torch gives a parameter the loss
        never reaches no gradient (``grad is None``), and torch.optim then skips it: no update, no weight decay,
        no state. JAX would give it a zero gradient and decay it; the optimizer here sees only these. (A frozen
        parameter, ``requires_grad=False``, is not among them at all: torchax keeps it with the buffers.)"""
        accum = self.program.step.grad_accum
        batch = {k: jax.ShapeDtypeStruct((v.shape[0] // accum, *v.shape[1:]), to_jax_dtype(v[:1], float_dtype).dtype)
                 for k, v in checked_batch(self.program.data, 0, self.program.seed).items()}
        env = self.lowered.env
        key = env.param.prng       # random ops (dropout) rotate torchax's key: no tracer of this trace may stay there
        try:
            with matmul_precision(self.program.precision.compute):
                closed = jax.make_jaxpr(lambda p, b: self.lowered(p, buffers, b)[0])(params, batch)
        finally:
            env.param.prng = key
        read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        used = {path[0].key for (path, _), var in zip(flat, closed.jaxpr.invars[:len(flat)]) if id(var) in read}
        return [n for n in self.lowered.param_names if n in used]

    def _loss(self, params: dict[str, Any], buffers: Any, batch: Any) -> Any:
        """The lowered loss of a state's parameters (the scanned layers' groups read stacked by the scan), its
        attention calls routed to the kernel ``StepOptions(attention=...)`` forces (backends/jaxjit/attention.py)."""
        with attention.routed(self.program.step.attention):
            if not self.stacks:
                return self.lowered(params, buffers, batch)
            assert self.scanner is not None
            with self.scanner.given({self.stacks.relative(k): params[k] for k in self.stacks.groups}):
                return self.lowered(self.stacks.unstack(params), buffers, batch)

    def _state_specs(self, state: dict[str, Any]) -> dict[str, Any]:
        """Parameters as planned; optimizer-state leaves that mirror a parameter follow it; the rest replicated."""
        params = state["params"]

        def spec_for(path: tuple, leaf: Any) -> P:
            for entry in reversed(path):
                key = getattr(entry, "key", None)
                if key is not None and key in params and getattr(leaf, "shape", None) == params[key].shape:
                    return P(*self.specs[key])
            return P()

        return jax.tree_util.tree_map_with_path(spec_for, {**state, "buffers": {}}) | {
            "buffers": {n: P() for n in state["buffers"]}}

    # ------------------------------------------------------------------ the step

    def _micro_grads(self, params: Any, buffers: Any, batch: Any, scale: Any, divisor: float,
                     gather: Callable[[Any], Any],
                     count_everywhere: Callable[[jax.Array], jax.Array]) -> tuple[Any, jax.Array, Any]:
        """Gradient (summed over micro-batches, each loss divided by accum*divisor, times the loss scale), the
        mean unscaled loss of this device's batch, and the buffers after the last micro-batch's forward (each
        micro-batch's forward sees the buffers the previous one left, as in eager).

        A loss returning ``xb.LossSum`` is differentiated as its total / divisor; the summed gradient and the summed
        total are then multiplied by ``divisor / count_everywhere(count)``: the count summed over this device's
        micro-batches, then over every device (a device holding the same rows as another counts them again, as its
        total does). Once the caller sums the gradients over the devices (and averages the loss over them: the
        ``divisor``), both are the global total over the global count."""
        accum = self.program.step.grad_accum

        def loss_fn(p: Any, mb: Any, bufs: Any) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
            loss, count, updated = self._loss(gather(p), bufs, mb)
            scaled = loss / (accum * divisor) if count is None else loss / divisor
            return (scaled * scale if scale is not None else scaled), (loss, count, updated)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum == 1:
            (_, (loss, count, updated)), grads = grad_fn(params, batch, buffers)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)
            summed: list[bool] = []     # filled while the body is traced: did the loss return xb.LossSum?

            def body(carry: Any, mb: Any) -> tuple[Any, None]:
                g_acc, l_acc, c_acc, bufs = carry
                (_, (loss, count, bufs)), g = grad_fn(params, mb, bufs)
                summed.append(count is not None)
                # a mean: the mean over the micro-batches; a LossSum: the totals and the counts summed
                l_acc = l_acc + loss / accum if count is None else l_acc + loss
                c_acc = c_acc + count if count is not None else c_acc
                return (jax.tree.map(jnp.add, g_acc, g), l_acc, c_acc, bufs), None

            init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32),
                    buffers)
            (grads, loss, count, updated), _ = jax.lax.scan(body, init, micro)
            count = count if summed[-1] else None
        if count is not None:
            items = count_everywhere(count)
            factor = divisor / _nonzero(items)
            grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
            loss = loss * factor
        return grads, loss, updated

    def _apply(self, state: dict[str, Any], grads: Any, loss: jax.Array, buffers: Any,
               reduce_sum: Callable[[str, jax.Array], jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        """Unscale, clip by global norm (torch's formula), optimizer update, loss-scale bookkeeping; the buffers
        the forward updated are kept. ``reduce_sum(name, x)`` totals a per-parameter scalar over the devices
        holding that parameter's shards."""
        spec = self.program.optimizer
        params = state["params"]
        new = dict(state, buffers=buffers)
        if self.scaling:
            inv = 1.0 / state["scaler"].scale
            grads = jax.tree.map(lambda g: (g * inv).astype(g.dtype), grads)
            bad = jnp.sum(jnp.stack([reduce_sum(n, jnp.sum(~jnp.isfinite(g)).astype(jnp.float32))
                                     for n, g in grads.items()]))
            finite = bad == 0
        # per parameter, how many gradient entries are NaN/Inf: names the culprit when the loss goes non-finite
        # (a scanned layers' group: one count per layer; in the order of ``self.bad_grad_names``)
        bad_grads = jnp.concatenate([reduce_sum(k, self.stacks.nonfinite_counts(k, grads[k])) for k in self.param_keys])
        # the global L2 norm, unscaled and before clipping (what torch's clip_grad_norm_ returns)
        norm = jnp.sqrt(sum((reduce_sum(n, jnp.sum(jnp.square(g.astype(jnp.float32)))) for n, g in grads.items()),
                            jnp.zeros((), jnp.float32)))
        clip = self.program.step.clip_grad_norm
        if clip is not None:
            coef = jnp.minimum(clip / (norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)
        lr = optimizers.learning_rate(spec, state["step"])
        trained = {n: params[n] for n in self.trained_keys}   # as torch.optim: a parameter without gradient is skipped
        direction, opt = self.tx.update({n: grads[n] for n in self.trained_keys}, state["opt"], trained)
        updated = {**params, **optax.apply_updates(trained, jax.tree.map(lambda u: -lr * u, direction))}
        if self.scaling:
            new["params"] = jax.tree.map(lambda a, b: jnp.where(finite, a, b), updated, params)
            new["opt"] = jax.tree.map(lambda a, b: jnp.where(finite, a, b), opt, state["opt"])
            new["scaler"] = optimizers.scaler_update(state["scaler"], finite)
        else:
            new["params"], new["opt"] = updated, opt
        new["step"] = state["step"] + 1
        return new, {"loss": loss, "lr": lr, "bad_grads": bad_grads, "grad_norm": norm}

    def _build(self) -> Any:        # a jitted function (jax.stages.Wrapped: called, and .lower() for --dump)
        scale_of = (lambda s: s["scaler"].scale) if self.scaling else (lambda s: None)
        metric_specs = {"loss": P(), "lr": P(), "bad_grads": P(), "grad_norm": P()}
        metrics = jax.tree.map(lambda s: NamedSharding(self.mesh, s), metric_specs)

        def jit(fn: Callable) -> Callable:
            # explicit layouts in and out keep the state where the plan put it, step after step
            return jax.jit(fn, in_shardings=(self.state_shardings, self.batch_sharding),
                           out_shardings=(self.state_shardings, metrics), donate_argnums=(0,))

        if self.mode == "gspmd":
            def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
                self.traces += 1
                grads, loss, buffers = self._micro_grads(state["params"], state["buffers"], batch, scale_of(state),
                                                         1.0, lambda p: p, lambda c: c)
                return self._apply(state, grads, loss, buffers, lambda name, x: x)

            return jit(step)

        axes = tuple(self.mesh.axis_names)
        n_devices = math.prod(self.plan.axis_sizes.values())
        sharded_axes = {n: tuple(spec_axes(s)) for n, s in self.specs.items()}

        def gather(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
            """All-gather every sharded dimension: the torch model sees full parameters."""
            full = {}
            for name, value in params.items():
                for dim, entry in enumerate(self.specs[name]):
                    if entry is not None:
                        value = jax.lax.all_gather(value, entry, axis=dim, tiled=True)
                full[name] = value
            return full

        def reduce_sum(name: str, x: jax.Array) -> jax.Array:
            return jax.lax.psum(x, sharded_axes[name]) if sharded_axes[name] else x

        def per_device(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
            self.traces += 1
            # Each device differentiates its local mean loss / n_devices. The transpose of all_gather sums the
            # gathered axes (psum_scatter); summing the remaining axes gives every device the global gradient.
            grads, loss, buffers = self._micro_grads(state["params"], state["buffers"], batch, scale_of(state),
                                                     float(n_devices), gather, lambda c: jax.lax.psum(c, axes))
            grads = {n: (jax.lax.psum(g, rest) if (rest := tuple(a for a in axes if a not in sharded_axes[n])) else g)
                     for n, g in grads.items()}
            loss = jax.lax.psum(loss, axes) / n_devices
            # each device's forward saw its own rows (as torch DDP without SyncBatchNorm): floating buffers are
            # averaged over the devices so that every device keeps the same value; counters agree already
            buffers = {n: (jax.lax.pmean(b, axes) if jnp.issubdtype(b.dtype, jnp.floating) else b)
                       for n, b in buffers.items()}
            return self._apply(state, grads, loss, buffers, reduce_sum)

        batch_specs = self.batch_spec
        mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=(self.state_specs, batch_specs),
                               out_specs=(self.state_specs, metric_specs), check_vma=False)
        return jit(mapped)

    # ------------------------------------------------------------------ the contract

    def local_rows(self, batch_size: int) -> np.ndarray:
        """The rows of the global batch this process's devices hold (all of them in one process)."""
        first = NamedSharding(self.mesh, P(*self.batch_spec[:1]))
        index = first.addressable_devices_indices_map((batch_size,))
        rows = np.asarray(sorted({r for sl in index.values() if sl for r in range(batch_size)[sl[0]]}),
                          dtype=np.int64)
        if len(rows) and not np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
            raise LoweringError(f"process {jax.process_index()}'s devices hold rows that are not one block of the "
                                f"batch ({rows.tolist()[:8]}...); put the batch's mesh axis first in the mesh")
        return rows

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], dict[str, np.ndarray]]) -> Any:
        """Several processes: each reads and checks only the rows its own devices hold (the source's ``rows``
        when it has one) and hands them to JAX as its part of the global batch."""
        if self.processes == 1:
            return super().fetch(source, step, seed, check)
        if self._local is None:
            rows = self.local_rows(source.batch_size)
            self._local = (BatchCheck(source, expected_rows=len(rows), rng_rows=rng_rows(self.program, rows)), rows)
        local_check, rows = self._local
        local = local_check(contract.rows(source, step, seed, rows), step)
        if isinstance(check, BatchCheck):      # the run loop reports what this process read
            check.bytes_read[step] = local_check.bytes_read.pop(step, 0)
        return self._global(local, source.batch_size)

    def _global(self, local: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
        """This process's rows of every key, made into global arrays split as the plan says."""
        float_dtype = jnp.dtype(self.program.precision.params)
        out = {}
        for key, value in local.items():
            array = to_jax_dtype(value, float_dtype)
            shape = (batch_size, *array.shape[1:])
            out[key] = jax.make_array_from_process_local_data(self.batch_sharding, array, shape)
        return out

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """On the devices, split as the plan says (``jax.device_put`` returns at once; the copy is asynchronous).
        On one device, an array already in the dtype JAX computes in and in memory XLA can use as it is (64-byte
        aligned, C order: a torch tensor's, as a collate function returns) crosses by DLPack without a copy."""
        if self.processes > 1:        # a whole batch (eval, traces): this process's rows of it
            size = next(iter(batch.values())).shape[0]
            rows = self.local_rows(size)
            return self._global({k: v[rows] for k, v in batch.items()}, size)
        float_dtype = jnp.dtype(self.program.precision.params)
        one_device = len(self.batch_sharding.device_set) == 1
        out = {}
        for key, value in batch.items():
            array = to_jax_dtype(value, float_dtype)
            # numpy's DLPack export knows the standard dtypes only (not ml_dtypes' bfloat16)
            if one_device and array.dtype.kind in "biuf" and array.flags.c_contiguous and array.ctypes.data % 64 == 0:
                out[key] = jax.device_put(jax.dlpack.from_dlpack(array), self.batch_sharding)   # no copy
            else:
                out[key] = jax.device_put(array, self.batch_sharding)
        return out

    def _placed(self, batch: Any) -> dict[str, jax.Array]:
        return self.put(batch) if on_host(batch) else batch

    def evaluate(self, batch: Any) -> float:
        """The loss in eval mode (traced once with every module's ``training`` off), jitted on its own."""
        if self._eval is None:
            model = self.lowered.module._model

            def loss_in_eval_mode(params: Any, buffers: Any, b: Any) -> jax.Array:
                with eval_mode(model):
                    loss, count, _ = self._loss(params, buffers, b)
                    return loss if count is None else loss / _nonzero(count)

            self._eval = jax.jit(loss_in_eval_mode, out_shardings=self.replicated)
            first = True
        else:
            first = False
        args = (self.state["params"], self.state["buffers"], self._placed(batch))
        with matmul_precision(self.program.precision.compute):
            if first and self.processes > 1:     # as the step: compiled ahead, saying so to the supervisor
                with processes.beating("compiling the evaluation"):
                    self._eval.lower(*args).compile()
            return float(self._eval(*args))

    def step(self, batch: Any) -> dict[str, float]:
        device_batch = self._placed(batch)
        self._last_batch = device_batch
        with matmul_precision(self.program.precision.compute):
            if self.processes > 1 and not self._compiled:
                # compiled ahead of the call (which then finds it compiled) while saying so to the supervisor: a
                # long first compile is not a hang, and a compile waits on no other process
                with processes.beating("compiling the step"):
                    self.jitted.lower(self.state, device_batch).compile()
                self._compiled = True
            self.state, metrics = self.jitted(self.state, device_batch)
        self._bad_grads = metrics["bad_grads"]
        # float() waits for the device
        return {"loss": float(metrics["loss"]), "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One forward pass of the loss run op by op through torchax (not jitted), hooks on every module."""
        from torchax import interop

        from xbridge.torch.module_outputs import recording

        to_numpy = lambda t: np.asarray(interop.jax_view(t).astype(jnp.float32))  # noqa: E731
        with recording(self.lowered.module._model, to_numpy) as out, matmul_precision(self.program.precision.compute):
            self._loss(self.state["params"], self.state["buffers"], self.put(batch))
        return out

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The products of the loss's jaxpr (traced, never compiled): what XLA is handed, attention's two products
        included."""
        from .lowering import count_products

        with matmul_precision(self.program.precision.compute):
            jaxpr = jax.make_jaxpr(self._loss)(self.state["params"], self.state["buffers"], self.put(batch))
        return count_products(jaxpr.jaxpr)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The kernel the lowering gives every ``scaled_dot_product_attention`` call (torchax's reference: matmuls,
        a softmax that XLA fuses as it can; or JAX's cuDNN attention); the calls are counted on the meta device."""
        from xbridge.torch.attention import meta_calls

        return meta_calls(self.program, attention.KERNELS[self.program.step.attention])

    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        """jax.profiler: ``plugins/profile/<time>/<host>.xplane.pb`` (TensorBoard's profile plugin, xprof) and the
        same trace as ``<host>.trace.json.gz`` (Chrome/Perfetto)."""
        directory.mkdir(parents=True, exist_ok=True)
        return jax.profiler.trace(str(directory))

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return jax.profiler.StepTraceAnnotation(STEP_MARK, step_num=step)

    def device_kind(self) -> str | None:
        return str(jax.local_devices(backend=self.target.device)[0].device_kind)

    def device_peak_bytes(self) -> int | None:
        """Peak bytes in use on the first device (None where the runtime keeps no statistics, as on CPU)."""
        stats = jax.local_devices(backend=self.target.device)[0].memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None

    def recompiles(self) -> int:
        return self.traces - self.warm_traces

    def mark_warm(self) -> None:
        self.warm_traces = self.traces

    def compile_cache(self) -> CompileCache | None:
        delta = {k: v - self._counts_start.get(k, 0) for k, v in _counts.items()}
        return CompileCache(int(delta.get("hits", 0)), int(delta.get("misses", 0)),
                            "JAX persistent compilation cache",
                            {name: round(delta[name], 3) for name in _DURATIONS.values() if delta.get(name)})

    def dump(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        with matmul_precision(self.program.precision.compute):
            lowered = self.jitted.lower(self.state, self._last_batch)
        stablehlo = directory / f"jax_{self.mode}_step.stablehlo.mlir"
        stablehlo.write_text(lowered.as_text())
        hlo = directory / f"jax_{self.mode}_step.optimized.hlo.txt"
        hlo.write_text(lowered.compile().as_text())
        return [stablehlo, hlo]
