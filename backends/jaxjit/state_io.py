"""The JAX executable's state as the rest of xbridge sees it: under the eager names, whatever the lowering holds
(scanned layers stacked, tied parameters once, the optimizer's own tree); gathered from every process or written
as each process's pieces; checkpoint arrays of any backend placed back, each device reading its slice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xbridge.contract import Executable, MultiProcess, PieceWriter, ShardedCheckpoint
from xbridge.ir.program import Program

from . import checkpoint_shards, optimizers
from .layer_stacks import Stacks
from .lowering import LoweredLoss


def _full(value: Any, dtype: Any) -> np.ndarray:
    return np.asarray(value).astype(dtype)


class JaxState(Executable, ShardedCheckpoint, MultiProcess):
    """What JaxExecutable sets up in ``init``, read and written here."""
    program: Program
    state: dict[str, Any]
    state_shardings: Any
    stacks: Stacks
    lowered: LoweredLoss
    names: list[str]                    # eager names of the parameters and buffers, eager order
    dtypes: dict[str, Any]
    trained: list[str]                  # canonical names the optimizer updates
    bad_grad_names: list[str]
    scaling: bool
    processes: int
    bad_grads_seen: jax.Array | None

    def host(self, tree: Any) -> Any:
        """Numpy copies of whole arrays: gathered from every process when the mesh spans several (every process
        calls this at the same point: it is a collective)."""
        if self.processes == 1:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)

    def state_dict(self) -> dict[str, np.ndarray]:
        host = self.host({"params": self.state["params"], "buffers": self.state["buffers"]})
        return self._model_state(self.stacks.unstack(host["params"]), host["buffers"], _full)

    def _model_state(self, params: Any, buffers: Any, convert: Callable[[Any, Any], Any]) -> dict[str, Any]:
        """Parameters and buffers under the eager names, each ``convert(value, dtype)``: floating ones in float32,
        the others in the dtype they came in."""
        out = {}
        for name in self.names:
            canonical = self.lowered.canonical.get(name)
            value = params[canonical] if canonical is not None else buffers[name]
            floating = jnp.issubdtype(value.dtype, jnp.floating)
            out[name] = convert(value, np.float32 if floating else self.dtypes[name])
        return out

    def eager_names(self) -> dict[str, str]:
        """Trained (canonical) name -> its eager name (the first of a tied group, as torch's named_parameters); only
        the parameters the optimizer updates (torch.optim keeps no state for the others)."""
        out: dict[str, str] = {}
        for eager, canonical in self.lowered.canonical.items():
            if canonical in self.trained:
                out.setdefault(canonical, eager)
        return out

    def _complex_names(self) -> frozenset[str]:
        """The trained parameters that are complex (their optimizer state is held as pairs: optimizers.py)."""
        return frozenset(name for name, eager in self.eager_names().items()
                         if np.issubdtype(self.dtypes[eager], np.complexfloating))

    def training_state(self) -> dict[str, np.ndarray]:
        return self._train_state(self.host({k: v for k, v in self.state.items() if k not in ("params", "buffers")}),
                                 _full)

    def _train_state(self, state: Any, convert: Callable[[Any, Any], Any]) -> dict[str, Any]:
        """The optimizer, the step count and the loss scaler under the checkpoint names, each ``convert(value,
        dtype)``."""
        def host(leaf: Any) -> Any:        # a complex parameter's state is complex, as torch keeps it
            return convert(leaf, np.complex64 if jnp.iscomplexobj(leaf) else np.float32)

        out = optimizers.export_state(self.stacks.unstack_tree(state["opt"]), self.eager_names(), host,
                                      self._complex_names())
        out["loop/updates"] = convert(state["step"], np.int64)
        if self.scaling:
            out["scaler/scale"] = convert(state["scaler"].scale, np.float32)
            out["scaler/growth_tracker"] = convert(state["scaler"].growth_tracker, np.int64)
        return out

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Checkpoint arrays (from any backend) into the optimizer state, each device reading its slice of each."""
        def place(value: Any, like: jax.Array) -> jax.Array:
            return checkpoint_shards.placed(optimizers.Cast(value, like.dtype), like.sharding)

        loaded = dict(self.state)
        loaded["opt"] = self.stacks.stack_tree(optimizers.import_state(self.stacks.unstack_tree(self.state["opt"]),
                                                                       state, self.eager_names(), place,
                                                                       self._complex_names()))
        loaded["step"] = np.asarray(np.asarray(state["loop/updates"]), dtype=np.int32)
        if self.scaling and "scaler/scale" in state:
            loaded["scaler"] = optimizers.ScalerState(np.asarray(np.asarray(state["scaler/scale"]), dtype=np.float32),
                                                      np.asarray(np.asarray(state["scaler/growth_tracker"]),
                                                                 dtype=np.int32))
        self.state = jax.device_put(loaded, self.state_shardings)

    def gathered(self, values: np.ndarray) -> np.ndarray:
        if self.processes == 1:
            return values[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(values))

    def piece_writer(self) -> PieceWriter | None:
        """One process: None (the state is written whole). Several: each process writes its pieces (its devices'
        shards, a replicated one by the replica numbered 0 only), nothing gathered, between the processes'
        barriers."""
        if self.processes == 1:
            return None
        from jax.experimental import multihost_utils

        from xbridge.plugin import shards

        group = shards.Group(jax.process_index(), self.processes, multihost_utils.sync_global_devices)

        def write(folder: Path) -> list[dict[str, Any]]:
            model = self._model_state(self.stacks.unstack(self.state["params"]), self.state["buffers"],
                                      checkpoint_shards.held)
            return [shards.write_part(folder, group, model, self._train_state(self.state, checkpoint_shards.held))]

        return PieceWriter(write, group)

    def param_shardings(self) -> dict[str, jax.sharding.Sharding]:
        """The live sharding of every trained parameter (for tests and inspection)."""
        return {n: a.sharding for n, a in self.stacks.unstack(self.state["params"]).items()}
