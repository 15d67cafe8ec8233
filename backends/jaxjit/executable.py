"""The JAX executable: state placement from the plan, one jitted train step (GSPMD or shard_map: built by
step_builders.py), batches onto the mesh (feeding.py: each process's rows under several processes), numpy I/O.

Built on compile-only devices (``devices=``, a TPU topology's: xbridge compile, ahead_of_time.py) it is abstract:
the model is built on the meta device and every array of the state is a ``jax.ShapeDtypeStruct`` with its
sharding, so the very steps ``run`` builds are lowered and compiled without one byte of weights."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xbridge.contract import Target, on_host
from xbridge.errors import BackendUnavailable, LoweringError
from xbridge.ir.program import Program
from xbridge.ir.sharding import Spec, spec_axes
from xbridge.plugin import (
    ShardingPlan,
    beating,
    cache_dir,
    checked_batch,
    hints,
    rng_rows,
    source_name,
)
from xbridge.torch import remat as shared_remat
from xbridge.torch.seeding import training_seed
from xbridge.torch.train import build_model, tensor_to_numpy

from . import attention, checkpoint_shards, layer_scan, optimizers, patches, remat, step_builders
from .capabilities import JaxDiagnostics, JaxProbes, JaxProfiling
from .feeding import BatchFeed, check_int32, to_jax_dtype
from .layer_stacks import Stacks
from .lowering import LoweredLoss, matmul_precision, sharding_hint
from .state_io import JaxState


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, on by default (JAX_COMPILATION_CACHE_DIR still wins)."""
    if not jax.config.jax_compilation_cache_dir:  # (flags are declared at run time)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir("jax")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class JaxExecutable(JaxState):
    """The program as one jitted train step over a mesh (GSPMD or shard_map); its diagnostics, probes and profiler:
    capabilities.py."""

    def __init__(self, program: Program, plan: ShardingPlan, target: Target, mode: str,
                 devices: Sequence[Any] | None = None) -> None:
        patches.apply()     # the jax stack's patches (patches.py), applied here alone, once per process
        self.program, self.plan, self.target, self.mode = program, plan, target, mode
        self.abstract = devices is not None     # compile-only devices: shapes and shardings, never arrays
        if not self.abstract:
            enable_compilation_cache()
        available = list(devices) if devices is not None else jax.devices(target.device)
        if len(available) < plan.devices:
            raise BackendUnavailable(f"target {target} has {len(available)} device(s), the plan needs {plan.devices}")
        sizes = plan.axis_sizes
        self.mesh = jax.sharding.Mesh(np.array(available[: plan.devices]).reshape(tuple(sizes.values())),
                                      tuple(sizes))
        self.replicated = NamedSharding(self.mesh, P())
        self.traces = 0
        self.parts = (JaxDiagnostics(self), JaxProbes(self), JaxProfiling())
        self._eval: Any = None
        self.scaling = program.precision.loss_scale == "dynamic"
        self.tx = optimizers.direction(program.optimizer)
        self.bad_grads_seen: jax.Array | None = None
        self.processes = jax.process_count()    # > 1: the mesh spans several processes (--processes)
        self._compiled = False

    # ------------------------------------------------------------------ state

    def init(self, weights: dict[str, Any]) -> None:     # numpy; shapes (jax.ShapeDtypeStruct) when abstract
        program = self.program
        attention.check(program.step.attention, str(self.target), self.mesh.devices.flat[0].platform)
        # the module gives shapes, ties and the non-persistent buffers; the parameters and buffers are placed from
        # ``weights`` below, each device's slice read on its own (a sharded checkpoint is never read whole)
        model = build_model(program, None, torch.device("meta" if self.abstract else "cpu"))
        shared_remat.apply(model, program, remat.checkpoint(program.step.remat))
        self.scanner = layer_scan.apply(model, program)    # after remat: each scanned layer runs as remat wrapped it
        self.lowered = LoweredLoss(program, model)
        self.native_key = jax.random.key(training_seed(program.seed))   # --rng native: folded with each step
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

        place = checkpoint_shards.abstract if self.abstract else checkpoint_shards.placed
        params = {n: place(weights[n], NamedSharding(self.mesh, P(*self.specs[n])), cast)
                  for n in self.lowered.param_names}
        # buffers (and frozen parameters, which torchax keeps with them) in the params dtype, bf16 too; a
        # non-persistent buffer (not in the state_dict) as the module built it
        buffers = {n: place(weights[n] if n in weights else (b if self.abstract else tensor_to_numpy(b)),
                            self.replicated, cast)
                   for n, b in self.lowered.module.buffers.items()}
        self.trained = self._params_the_loss_uses(params, buffers, float_dtype)
        self._refuse_changes_it_cannot_carry()
        self.stacks = Stacks.of_scan(self.scanner, self.lowered.canonical, self.trained, self.specs, params)
        params = self.stacks.stack(params, checkpoint_shards.abstract_stack if self.abstract else jnp.stack)
        for key in self.stacks.groups:
            self.specs[key] = self.stacks.spec_of(key, self.specs)
        self.trained_keys = self.stacks.keys(self.trained)
        self.param_keys = self.stacks.keys(self.lowered.param_names)
        self.bad_grad_names = [n for key in self.param_keys for n in self.stacks.names_of(key)]
        trained = {n: params[n] for n in self.trained_keys}
        opt = jax.eval_shape(self.tx.init, trained) if self.abstract else self.tx.init(trained)
        state = {"params": params, "opt": opt, "buffers": buffers, "step": jnp.int32(0)}
        if self.scaling:
            state["scaler"] = optimizers.scaler_init()
        self.state_specs = self._state_specs(state)
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs,
                                            is_leaf=lambda x: isinstance(x, P))
        self.state = (jax.tree.map(checkpoint_shards.shape_of, state, self.state_shardings) if self.abstract
                      else jax.device_put(state, self.state_shardings))
        batch_spec = P(*self.plan.batch)
        self.batch_sharding = NamedSharding(self.mesh, batch_spec)
        self.batch_spec = batch_spec
        self.feed = BatchFeed(program, self.mesh, batch_spec, self.batch_sharding, self.processes)
        self.jitted = step_builders.train_step(self)

    def _params_the_loss_uses(self, params: dict[str, Any], buffers: dict[str, Any], float_dtype: Any) -> list[str]:
        """The parameters the loss reads (in the traced loss of one micro-batch). torch gives a parameter the loss
        never reaches no gradient (``grad is None``), and torch.optim then skips it: no update, no weight decay,
        no state. JAX would give it a zero gradient and decay it; the optimizer here sees only these. (A frozen
        parameter, ``requires_grad=False``, is not among them at all: torchax keeps it with the buffers.)"""
        accum = self.program.step.grad_accum
        batch = {k: jax.ShapeDtypeStruct((v.shape[0] // accum, *v.shape[1:]), to_jax_dtype(v[:1], float_dtype).dtype)
                 for k, v in checked_batch(self.program.data, 0, self.program.seed, rng_rows(self.program)).items()}
        env = self.lowered.env
        key = env.param.prng       # random ops (dropout) rotate torchax's key: no tracer of this trace may stay there
        changed: list[str] = []

        def loss(p: Any, bufs: Any, b: Any) -> Any:
            value, _, updated = self.lowered(p, bufs, b)
            changed.extend(n for n in updated if n in p)
            return value

        try:
            with matmul_precision(self.program.precision.compute):
                closed = jax.make_jaxpr(loss)(params, buffers, batch)
        finally:
            env.param.prng = key
        self.changed_in_forward = changed      # parameters the forward changes in place (step_builders carries them)
        read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        used = {path[0].key for (path, _), var in zip(flat, closed.jaxpr.invars[:len(flat)]) if id(var) in read}
        return [n for n in self.lowered.param_names if n in used]

    def _refuse_changes_it_cannot_carry(self) -> None:
        """A parameter the forward changes in place is carried into the update (step_builders.py) where the step
        holds it whole: not a layer of a scanned stack, nor a shard of one split under shard_map."""
        for name in self.changed_in_forward:
            scanned = self.scanner is not None and name.startswith(f"{self.scanner.path}.")
            split = self.mode == "shard_map" and any(entry is not None for entry in self.specs.get(name, ()))
            if scanned or split:
                why = "a layer of the scanned stack (scan_layers)" if scanned else "split over the mesh under shard_map"
                raise LoweringError(f"the forward of program {self.program.name!r} changes parameter {name!r} in "
                                    f"place, and it is {why}, where the jax backend cannot carry the change into "
                                    "the next step; change it outside the forward, or run with "
                                    f"{'--sharding-mode gspmd' if split else 'the layers unrolled'}")

    def loss_of(self, params: dict[str, Any], buffers: Any, batch: Any, key: jax.Array | None = None) -> Any:
        """The lowered loss of a state's parameters (the scanned layers' groups read stacked by the scan), its
        attention calls routed to the kernel ``StepOptions(attention=...)`` forces (backends/jaxjit/attention.py);
        ``key``: the step's ``--rng native`` key (:meth:`LoweredLoss.__call__`)."""
        rows = tuple(spec_axes(self.plan.batch[:1]))      # the mesh axes the batch's rows are split over
        with attention.routed(self.program.step.attention, mesh=self.mesh, batch_axes=rows):
            if not self.stacks:
                return self.lowered(params, buffers, batch, key)
            assert self.scanner is not None
            with self.scanner.given({self.stacks.relative(k): params[k] for k in self.stacks.groups}):
                return self.lowered(self.stacks.unstack(params), buffers, batch, key)

    def _state_specs(self, state: dict[str, Any]) -> dict[str, Any]:
        """Parameters as planned; optimizer-state leaves that mirror a parameter follow it; the rest replicated."""
        params = state["params"]

        def spec_for(path: tuple, leaf: Any) -> P:
            for entry in reversed(path):
                key = getattr(entry, "key", None)
                # (a complex parameter's optimizer state is its pairs: a trailing axis of 2, optimizers.py)
                if key is not None and key in params and getattr(leaf, "shape", None) in (
                        params[key].shape, (*params[key].shape, 2) if jnp.iscomplexobj(params[key]) else None):
                    return P(*self.specs[key])
            return P()

        return jax.tree_util.tree_map_with_path(spec_for, {**state, "buffers": {}}) | {
            "buffers": {n: P() for n in state["buffers"]}}

    # ------------------------------------------------------------------ the contract

    def local_rows(self, batch_size: int) -> np.ndarray:
        """The rows of the global batch this process's devices hold (all of them in one process)."""
        return self.feed.local_rows(batch_size)

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], dict[str, np.ndarray]]) -> Any:
        """Several processes: each reads and checks only the rows its own devices hold (backends/jaxjit/feeding.py)."""
        if self.processes == 1:
            batch = check(source.batch(step, seed), step)
            check_int32(batch, f"data {source_name(source)}, {getattr(check, 'label', 'step')} {step}")
            return self.put(batch)
        return self.feed.fetch(source, step, seed, check)

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """On the devices, split as the plan says (backends/jaxjit/feeding.py)."""
        return self.feed.put(batch)

    def _placed(self, batch: Any) -> dict[str, jax.Array]:
        return self.put(batch) if on_host(batch) else batch

    def evaluate(self, batch: Any) -> float:
        """The loss in eval mode (traced once with every module's ``training`` off), jitted on its own."""
        if self._eval is None:
            self._eval = step_builders.eval_step(self)
            first = True
        else:
            first = False
        args = (self.state["params"], self.state["buffers"], self._placed(batch))
        with matmul_precision(self.program.precision.compute):
            if first and self.processes > 1:     # as the step: compiled ahead, saying so to the supervisor
                with beating("compiling the evaluation"):
                    self._eval.lower(*args).compile()
            return float(self._eval(*args))

    def step(self, batch: Any) -> dict[str, float]:
        device_batch = self._placed(batch)
        self.last_batch = device_batch
        with matmul_precision(self.program.precision.compute):
            if self.processes > 1 and not self._compiled:
                # compiled ahead of the call (which then finds it compiled) while saying so to the supervisor: a
                # long first compile is not a hang, and a compile waits on no other process
                with beating("compiling the step"):
                    self.jitted.lower(self.state, device_batch).compile()
                self._compiled = True
            self.state, metrics = self.jitted(self.state, device_batch)
        self.bad_grads_seen = metrics["bad_grads"]
        # float() waits for the device
        out = {"loss": float(metrics["loss"]), "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}
        count = float(metrics["count"])     # xb.LossSum's global count (NaN: the loss is a mean)
        return out if math.isnan(count) else {**out, "count": count}
