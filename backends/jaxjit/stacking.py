"""The scanned layers' trained parameters kept stacked between steps (``StepOptions(scan_layers=True)`` on jax).

Scanning the layers makes the forward and backward pass one layer whatever the depth, but everything done per
parameter outside the scan still grows with it: the optimizer update, clipping, the gradient norm and the count of
non-finite entries are one small XLA kernel each per parameter (12 per GPT layer: at 24 layers, 1100 kernels that
XLA:CPU compiles one by one), and stacking each layer's parameters for the scan in every step costs a copy of them.
So the state holds one array per layer-relative name (``blocks.*.q.weight``, the layers on a new leading axis), the
scan reads it as it is (:meth:`backends.jaxjit.scan.JaxScan.given`), and the optimizer state, the norm and the update
are computed on it: one kernel per name instead of one per layer.

What reads or writes the state by eager names (state_dict, checkpoints, the layout, the per-parameter non-finite
report) goes through :meth:`Stacks.unstack` and :meth:`Stacks.stack`, so nothing outside the jax step sees a
stacked array."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

SEPARATOR = ".*."      # blocks.*.q.weight: the stacked q.weight of every layer of blocks


class Stacks:
    """Groups of parameters (canonical names, in layer order) each held as one stacked array under its key."""

    def __init__(self, path: str, groups: dict[str, list[str]]) -> None:
        self.path, self.groups = path, groups
        self.member = {name: (key, i) for key, names in groups.items() for i, name in enumerate(names)}

    @classmethod
    def build(cls, path: str, count: int, relative: list[str], trained: list[str], specs: dict[str, Any],
              shapes: dict[str, tuple[int, ...]], aliased: set[str]) -> Stacks:
        """A group for each layer-relative parameter name whose copy in every one of the ``count`` layers of
        ``path`` is trained, tied to nothing (``aliased``: the names that share a parameter) and planned alike."""
        groups = {}
        for rel in relative:
            names = [f"{path}.{i}.{rel}" for i in range(count)]
            if (all(n in trained and n not in aliased for n in names)
                    and len({tuple(specs[n]) for n in names}) == 1 and len({shapes[n] for n in names}) == 1):
                groups[f"{path}{SEPARATOR}{rel}"] = names
        return cls(path, groups)

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

    def __bool__(self) -> bool:
        return bool(self.groups)

    def relative(self, key: str) -> str:
        return key[len(self.path) + len(SEPARATOR):]

    def keys(self, names: list[str]) -> list[str]:
        """``names`` with the grouped ones replaced by their group's key (at the first member's place)."""
        out: list[str] = []
        for name in names:
            key = self.member.get(name, (name, 0))[0]
            if key not in out:
                out.append(key)
        return out

    def spec(self, member_spec: tuple) -> tuple:
        return (None, *member_spec)

    def stack(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Members replaced by their group's stacked array; the rest as they are."""
        out = {n: v for n, v in flat.items() if n not in self.member}
        for key, names in self.groups.items():
            if names[0] in flat:
                out[key] = jnp.stack([flat[n] for n in names])
        return out

    def unstack(self, stacked: dict[str, Any]) -> dict[str, Any]:
        """Each group's key replaced by its members, each its layer's slice (numpy or JAX arrays alike)."""
        out = {n: v for n, v in stacked.items() if n not in self.groups}
        for key, names in self.groups.items():
            if key in stacked:
                out.update({n: stacked[key][i] for i, n in enumerate(names)})
        return out

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

    def names_of(self, key: str) -> list[str]:
        return self.groups.get(key, [key])
