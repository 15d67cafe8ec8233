"""Which of the scanned layers' parameters a backend holds stacked between steps, and the names on both sides: the
rules jax and xla share (:class:`LayerStacks`; backends/jaxjit/layer_stacks.py holds the stacks as JAX arrays,
:class:`StackedParams` below as torch parameters on xla).

Scanning the layers makes the forward and backward pass one layer whatever the depth, but everything done per
parameter outside the scan still grows with it: the optimizer update, clipping, the gradient norm and the count of
non-finite entries are one small kernel each per parameter (12 per GPT layer: at 24 layers over a thousand kernels
that XLA:CPU compiles one by one), and stacking each layer's parameters for the scan in every step costs a copy of
them. So a backend holds one array per layer-relative name (``blocks.*.q.weight``, the layers on a new leading axis),
the scan reads it as it is, and the update works on it: one kernel per name instead of one per layer.

What reads or writes the state by eager names (state_dict, checkpoints, the layout, the per-parameter non-finite
report) goes through :meth:`LayerStacks.unstack` and :meth:`LayerStacks.unstack_entries` and their inverses, so
nothing outside a backend's step sees a stacked array.

The torch side, :class:`StackedParams`: the scanned layers' trained parameters held stacked between steps on a
torch backend that scans them (xla), one ``nn.Parameter`` per layer-relative name (``blocks.*.q.weight``, the layers
on a new leading axis) that the scan reads as it is and torch.optim updates as one tensor.

The members are taken out of their modules (``del module._parameters[name]``): the device holds each weight once,
and nothing can read a stale copy. The scan's body substitutes every layer's weights anyway
(``torch.func.functional_call``). What reads the model by eager names (state_dict, checkpoints, the layout, the
non-finite report) asks :class:`StackedParams`, which unstacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from .train import tied_groups

if TYPE_CHECKING:
    from .layer_scan import LayerScan

SEPARATOR = ".*."      # blocks.*.q.weight: the stacked q.weight of every layer of blocks
_OPTIM = "optim/"      # checkpoint entries of the optimizer state: optim/<parameter>/<slot> (TrainStep.export_state)


class LayerStacks:
    """Groups of parameters (eager names, in layer order) each held as one stacked array under its key."""

    def __init__(self, path: str, groups: dict[str, list[str]]) -> None:
        self.path, self.groups = path, groups
        self.member = {name: (key, i) for key, names in groups.items() for i, name in enumerate(names)}

    @classmethod
    def build(cls, path: str, count: int, relative: list[str], trained: Sequence[str] | set[str],
              specs: dict[str, Any], shapes: dict[str, tuple[int, ...]], aliased: set[str]) -> Self:
        """A group for each layer-relative parameter name whose copy in every one of the ``count`` layers of
        ``path`` is trained, tied to nothing (``aliased``: the names that share a parameter), planned alike and not
        a scalar (a stacked slot is told from a per-parameter count, such as Adam's step, by its shape)."""
        trained = set(trained)
        groups = {}
        for rel in relative:
            names = [f"{path}.{i}.{rel}" for i in range(count)]
            if (all(n in trained and n not in aliased for n in names) and len({tuple(specs[n]) for n in names}) == 1
                    and len({shapes[n] for n in names}) == 1 and shapes[names[0]] != ()):
                groups[f"{path}{SEPARATOR}{rel}"] = names
        return cls(path, groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def relative(self, key: str) -> str:
        """``blocks.*.q.weight`` -> ``q.weight``."""
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
        """A group's sharding: its members' along the layer axis, which is whole on every device."""
        return (None, *member_spec)

    def spec_of(self, key: str, specs: dict[str, Any]) -> tuple:
        """The sharding of ``key`` given every eager name's (``specs``): a group's is :meth:`spec` of its first
        member's, any other name's its own."""
        return self.spec(tuple(specs[self.groups[key][0]])) if key in self.groups else tuple(specs[key])

    def names_of(self, key: str) -> list[str]:
        return self.groups.get(key, [key])

    def stack(self, flat: dict[str, Any], stack: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """Members replaced by their group's stacked array (``stack`` of the members in layer order); the rest as
        they are."""
        out = {n: v for n, v in flat.items() if n not in self.member}
        for key, names in self.groups.items():
            if names[0] in flat:
                out[key] = stack([flat[n] for n in names])
        return out

    def unstack(self, stacked: dict[str, Any]) -> dict[str, Any]:
        """Each group's key replaced by its members, each its layer's slice (numpy, JAX or torch arrays alike)."""
        out = {n: v for n, v in stacked.items() if n not in self.groups}
        for key, names in self.groups.items():
            if key in stacked:
                out.update({n: stacked[key][i] for i, n in enumerate(names)})
        return out

    def unstack_entries(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint entries ``optim/<name>/<slot>`` of a group's key as each member's: a slot shaped like the group
        (Adam's moments) sliced per layer, any other (a step count) repeated."""
        out: dict[str, Any] = {}
        for entry, value in entries.items():
            key, slot = _split(entry)
            if key not in self.groups:
                out[entry] = value
                continue
            names = self.groups[key]
            layered = len(getattr(value, "shape", ())) > 0 and value.shape[0] == len(names)
            for i, name in enumerate(names):
                out[f"{_OPTIM}{name}/{slot}"] = value[i] if layered else value
        return out

    def stack_entries(self, entries: dict[str, Any], member_shapes: dict[str, tuple[int, ...]],
                      stack: Callable[[list[Any]], Any]) -> dict[str, Any]:
        """The inverse of :meth:`unstack_entries`: each group's members' slots under the group's key, stacked when
        shaped like the member (``member_shapes``: each group key's member shape), else the first layer's."""
        out: dict[str, Any] = {}
        slots: dict[tuple[str, str], dict[int, Any]] = {}
        for entry, value in entries.items():
            name, slot = _split(entry)
            if name not in self.member:
                out[entry] = value
                continue
            key, index = self.member[name]
            slots.setdefault((key, slot), {})[index] = value
        for (key, slot), values in slots.items():
            count = len(self.groups[key])
            if len(values) != count:
                missing = [self.groups[key][i] for i in range(count) if i not in values]
                raise KeyError(f"{_OPTIM}{missing[0]}/{slot}")
            first = values[0]
            same = tuple(getattr(first, "shape", ())) == tuple(member_shapes[key])
            out[f"{_OPTIM}{key}/{slot}"] = stack([values[i] for i in range(count)]) if same else first
        return out


def _split(entry: str) -> tuple[str, str]:
    """``optim/blocks.0.q.weight/exp_avg`` -> (``blocks.0.q.weight``, ``exp_avg``); other entries -> ('', '')."""
    if not entry.startswith(_OPTIM):
        return "", ""
    name, _, slot = entry[len(_OPTIM):].rpartition("/")
    return name, slot


class StackedParams:
    """The model's trained parameters under their optimizer names: the scanned layers' grouped ones stacked."""

    def __init__(self, model: torch.nn.Module, stacks: LayerStacks, held: dict[str, torch.nn.Parameter],
                 order: list[str]) -> None:
        self.model, self.stacks, self.held, self.order = model, stacks, held, order

    @classmethod
    def hold(cls, model: torch.nn.Module, scanner: LayerScan | None, specs: dict[str, tuple],
             mark: Callable[[torch.Tensor, tuple], Any]) -> StackedParams:
        """Stack ``scanner``'s layers' parameters (nothing without a scan) and take the members out of their
        modules; ``mark`` places each stacked parameter with its sharding (the members' along the layer axis)."""
        order = list(model.state_dict())
        if scanner is None:
            return cls(model, LayerStacks("", {}), {}, order)
        params = dict(model.named_parameters())
        aliased = {n for group in tied_groups(model) for n in group}
        stacks = LayerStacks.build(scanner.path, len(scanner.layers),
                                   [n for n, _ in scanner.layers[0].named_parameters()],
                                   {n for n, p in params.items() if p.requires_grad}, specs,
                                   {n: tuple(p.shape) for n, p in params.items()}, aliased)
        held = {}
        for key, names in stacks.groups.items():
            with torch.no_grad():
                stacked = torch.nn.Parameter(torch.stack([params[n] for n in names]))
            mark(stacked, stacks.spec(specs[names[0]]))
            held[key] = stacked
            for name in names:
                owner, _, attr = name.rpartition(".")
                del model.get_submodule(owner)._parameters[attr]
        scanner.held = {stacks.relative(key): p for key, p in held.items()}
        return cls(model, stacks, held, order)

    def __bool__(self) -> bool:
        return bool(self.held)

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) in the model's order, each group under its key at its first member's place."""
        if not self.held:
            return list(self.model.named_parameters())
        out, placed = [], set()
        rest = dict(self.model.named_parameters())
        for name in self.order:
            if name in rest:
                out.append((name, rest[name]))
            elif name in self.stacks.member:
                key = self.stacks.member[name][0]
                if key not in placed:
                    placed.add(key)
                    out.append((key, self.held[key]))
        return out

    def member_shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(p.shape[1:]) for key, p in self.held.items()}

    def state_dict(self, convert: Callable[[torch.Tensor], np.ndarray]) -> dict[str, np.ndarray]:
        """The model's state under the eager names, in the model's order (each member its layer's slice)."""
        state = {**self.model.state_dict(), **self.stacks.unstack(dict(self.held))}
        return {name: convert(state[name]) for name in self.order}

    def nonfinite(self) -> list[str]:
        """Eager names (model order) of parameters whose gradient holds a NaN or Inf, one layer of a group each."""
        bad: set[str] = set()
        for name, param in self.named():
            if param.grad is None:
                continue
            if name in self.held:
                per_layer = torch.isfinite(param.grad).flatten(1).all(dim=1).cpu().tolist()
                bad.update(n for n, ok in zip(self.stacks.names_of(name), per_layer) if not ok)
            elif not bool(torch.isfinite(param.grad).all()):
                bad.add(name)
        return [name for name in self.order if name in bad]
