"""The scanned layers' trained parameters kept stacked between steps (``StepOptions(scan_layers=True)`` on jax): the
grouping and the names are xbridge/torch/layer_stacks.py's (shared with xla); here the JAX side. The state holds one
array per layer-relative name (``blocks.*.q.weight``), the scan reads it as it is
(:meth:`backends.jaxjit.layer_scan.JaxScan.given`), and the optimizer state, the norm and the update are computed on it:
one kernel per name instead of one per layer.
optax's state is a tree, so its per-parameter dicts are stacked and unstacked where they are found
(:meth:`Stacks.stack_tree`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from xbridge.torch.layer_stacks import SEPARATOR, LayerStacks

__all__ = ["SEPARATOR", "Stacks"]


class Stacks(LayerStacks):
    """:class:`LayerStacks` over JAX arrays."""

    @classmethod
    def of_scan(cls, scanner: Any, canonical: dict[str, str], trained: list[str], specs: dict[str, Any],
                params: dict[str, Any]) -> Stacks:
        """The trained parameters of ``scanner``'s layers to hold stacked (none without a scan); ``canonical``:
        each eager name's canonical (untied) name."""
        if scanner is None:
            return cls("", {})
        tied = {c for c in canonical.values() if sum(v == c for v in canonical.values()) > 1}
        return cls.build(scanner.path, len(scanner.layers), [n for n, _ in scanner.layers[0].named_parameters()],
                         trained, specs, {n: tuple(a.shape) for n, a in params.items()}, tied)

    def stack(self, flat: dict[str, Any], stack: Any = jnp.stack) -> dict[str, Any]:
        """Members replaced by their group's stacked array (``jnp.stack``); the rest as they are."""
        return super().stack(flat, stack)

    def _map_param_dicts(self, tree: Any, fn: Any, marks: Any) -> Any:
        """``tree`` with ``fn`` applied to every dict keyed by parameter names (one holding a key of ``marks``)."""
        if isinstance(tree, dict):
            return fn(tree) if any(k in marks for k in tree) else tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*(self._map_param_dicts(t, fn, marks) for t in tree))
        if isinstance(tree, (tuple, list)):
            return type(tree)(self._map_param_dicts(t, fn, marks) for t in tree)
        return tree

    def unstack_tree(self, tree: Any) -> Any:
        """An optimizer state whose per-parameter dicts hold stacked arrays, with its members' slices instead."""
        return self._map_param_dicts(tree, self.unstack, self.groups)

    def stack_tree(self, tree: Any) -> Any:
        """An optimizer state keyed by parameter names, with each group's members stacked."""
        return self._map_param_dicts(tree, self.stack, self.member)

    def nonfinite_counts(self, key: str, grad: jax.Array) -> jax.Array:
        """How many entries of the gradient under ``key`` are NaN or Inf: one count, or one per layer of a group."""
        bad = ~jnp.isfinite(grad)
        if key in self.groups:
            return jnp.sum(bad, axis=tuple(range(1, grad.ndim))).astype(jnp.float32)
        return jnp.sum(bad).astype(jnp.float32).reshape(1)
