"""Scan over layers, the part jax and xla share (``StepOptions(scan_layers=True, layers=...)``): how the model's own
loop is taken over by one scan, whichever compiler's scan runs it.

The model's loop stays as the user wrote it (``for block in self.blocks: x = block(x)``). The first layer's forward
runs the backend's scan over every layer: the scan body calls the first layer's module with each layer's parameters
and buffers substituted (``torch.func.functional_call``). The carry is the first positional argument (the hidden
states); every other argument is the same for every layer (masks, position embeddings). The later layers then receive
the scan's result and return it unchanged; each checks that it is called in order on the previous layer's output, so a
model that does something else between its layers is refused rather than computed wrongly.

The parameters keep their eager names (``blocks.3.q.weight``): state, checkpoints and parity see the model as written.
A backend subclasses :class:`LayerScan` and implements :meth:`LayerScan.scan`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from xbridge.errors import ConfigError

_looping = [False]


@contextlib.contextmanager
def looping() -> Iterator[None]:
    """While active, a scan runs the scan body over the layers in a Python loop (:meth:`LayerScan.loop`): for the
    backends' operator-by-operator censuses (matrix-product dtypes, attention kernels), which see the layers' code
    as it runs rather than a compiler's traces of it (AOTAutograd traces a torch_xla scan's body more than once)."""
    before, _looping[0] = _looping[0], True
    try:
        yield
    finally:
        _looping[0] = before


class LayerScan:
    """Takes over ``layers``' forwards: the first runs :meth:`scan` over all of them, the others pass its result on."""

    def __init__(self, path: str, layers: torch.nn.ModuleList) -> None:
        self.path, self.layers = path, layers
        self.layer_forward = layers[0].forward       # as remat left it, if it did
        first = layers[0]
        self.names = [n for n, _ in [*first.named_parameters(), *first.named_buffers()]]
        self.held: dict[str, torch.Tensor] = {}     # layer-relative name -> the layers' stacked parameter
        self.inside = False
        self.expected: torch.Tensor | None = None
        self.next = 0
        layers[0].forward = self.run
        for i, layer in enumerate(layers):
            if i:
                layer.forward = self._passthrough(i)

    def scan(self, hidden: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The backend's scan of :meth:`call_first` over the layers' weights (:meth:`weights`), from ``hidden``."""
        raise NotImplementedError

    def weights(self) -> dict[str, list[torch.Tensor]]:
        """Each parameter and buffer name of a layer -> that tensor of every layer, in order."""
        per_layer = self._per_layer()
        return {name: list(self.held[name].unbind(0)) if name in self.held else [t[name] for t in per_layer]
                for name in self.names}

    def stacked_weights(self) -> dict[str, torch.Tensor]:
        """Each parameter and buffer name of a layer -> every layer's on a leading axis: the parameters the backend
        holds stacked (:attr:`held`, xbridge/torch/layer_stacks.py) as they are, the rest stacked now."""
        per_layer = self._per_layer()
        return {name: self.held[name] if name in self.held else torch.stack([t[name] for t in per_layer])
                for name in self.names}

    def _per_layer(self) -> list[dict[str, torch.Tensor]]:
        return [dict([*layer.named_parameters(), *layer.named_buffers()]) for layer in self.layers]

    def call_first(self, weights: dict[str, Any], hidden: torch.Tensor, rest: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> torch.Tensor:
        """The first layer's module run with one layer's ``weights``: the scan body."""
        self.inside = True
        try:
            out = torch.func.functional_call(self.layers[0], weights, (hidden, *rest), kwargs)
        finally:
            self.inside = False
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(hidden.shape):
            raise ConfigError(f"StepOptions scan_layers: {self.path}.0 must return one tensor shaped like its first "
                              "argument, which the scan carries to the next layer; it returned "
                              f"{type(out).__name__}")
        return out

    def loop(self, hidden: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """What the scan computes, as a Python loop of its body."""
        weights = self.weights()
        for i in range(len(self.layers)):
            hidden = self.call_first({name: tensors[i] for name, tensors in weights.items()}, hidden, rest, kwargs)
        return hidden

    def _passthrough(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.next != index or not args or args[0] is not self.expected:
                raise ConfigError(f"StepOptions scan_layers: {self.path}.{index} was not called on the output of "
                                  f"{self.path}.{index - 1}; a scan over layers needs the model to call its layers "
                                  "in order, each on the previous one's output, with nothing in between")
            self.next = (index + 1) % len(self.layers)
            return args[0]

        return forward

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside:                      # the scan body calling the first layer's module
            return self.layer_forward(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            raise ConfigError(f"StepOptions scan_layers: {self.path}.0 takes no tensor as its first positional "
                              "argument, which a scan carries from layer to layer")
        result = (self.loop if _looping[0] else self.scan)(args[0], args[1:], kwargs)
        self.expected, self.next = result, 1
        return result
