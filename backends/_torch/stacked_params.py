"""The scanned layers' trained parameters held stacked between steps, on a torch backend that scans them (xla): one
``nn.Parameter`` per layer-relative name (``blocks.*.q.weight``, the layers on a new leading axis) that the scan reads
as it is and torch.optim updates as one tensor. Which parameters are grouped, and the names on both sides, are
backends/layer_stacks.py's (shared with jax).

The members are taken out of their modules (``del module._parameters[name]``): the device holds each weight once,
and nothing can read a stale copy. The scan's body substitutes every layer's weights anyway
(``torch.func.functional_call``). What reads the model by eager names (state_dict, checkpoints, the layout, the
non-finite report) asks :class:`StackedParams`, which unstacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..layer_stacks import LayerStacks
from .layer_scan import LayerScan
from .train import tied_groups


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
