"""The XLA ``While`` loops of xbridge's scanned layers, lowered once and reused in every step.

torch_xla 2.9's scan caches the layer's traced forward and backward graphs (``is_fn_pure``), but not their lowering:
each call of its ``_scan_impl_pytree`` runs the traced graph again on placeholder tensors, lowers it to HLO and builds
the ``While`` loop around it, for the forward scan and again for the backward one. Measured on the GPT at 2 layers
(XLA:CPU, 2 cores): 14 ms each, about 30 ms of host work per step that the unrolled step does not have, which is why
the scanned step cost more than the unrolled one at shallow depths.

:func:`scan_impl_pytree` is a caching ``_scan_impl_pytree``, which backends/xlaspmd/patches.py puts in place in
torch_xla's scan module (the autograd function ``Scan`` looks it up there at every call). For the loops of registered
functions (:func:`remember`: the forward and backward of xbridge's scan bodies, which are refused when they draw random
numbers, so the loop holds no per-call seed) it keeps what torch_xla built the first time — the loop computation, the
constants the body's trace made parameters of it, and the output structure — and afterwards calls the same computation
on the new carry and inputs (``_xla_user_computation``, as torch_xla does itself; patches.py records the computation
torch_xla builds). The key is everything the lowering depends on: the function, the direction, the inputs' structure,
shapes, dtypes and shardings, and autocast. torch_xla's SPMD backward shards each layer's gradient like that layer's
input inside the loop body, which would make the forward's inputs parameters of the loop; here that constraint is put
on the loop's results instead (:func:`_shard_like`). Any other scan (a user's own) goes to torch_xla's function
unchanged."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from . import patches

_LOOPS: weakref.WeakKeyDictionary[Any, dict[Any, _Loop]] = weakref.WeakKeyDictionary()
_BODIES: weakref.WeakSet[Any] = weakref.WeakSet()
_HITS = [0]


@dataclass
class _Loop:
    computation: Any                        # the While computation torch_xla built
    ys: list[tuple[torch.Size, torch.dtype]]  # the stacked outputs' shapes (fresh zeros each call)
    hoisted: list[torch.Tensor]             # constants of the traced body, parameters of the loop
    carries: int
    unflatten_y: Callable[[list[torch.Tensor]], Any]


def remember(body: Callable[..., Any]) -> None:
    """Cache the loops of the forward and backward functions torch_xla's scan makes of ``body`` (an xbridge scan
    body, traced with ``is_fn_pure``, so torch_xla keeps those functions in its ``_SCAN_COMPUTATION_CACHE``)."""
    _BODIES.add(body)


def _loops(fn: Any) -> dict[Any, _Loop] | None:
    """The cached loops of ``fn`` if it is the forward or backward of a remembered body, else None."""
    from torch_xla.experimental.scan import _SCAN_COMPUTATION_CACHE

    if fn in _LOOPS:
        return _LOOPS[fn]
    for body in _BODIES:
        for forward, _alias_input, backward in _SCAN_COMPUTATION_CACHE.get(body, {}).values():
            if fn is forward or fn is backward:
                return _LOOPS.setdefault(fn, {})
    return None


def hits() -> int:
    """How many scans reused a cached loop so far in this process (for tests)."""
    return _HITS[0]


def _unwrap(fn: Any) -> tuple[Any, tuple[Any, Any] | None]:
    """The function a scan runs and, for torch_xla's SPMD backward (``partial(_backward_shard_alike, backward=...,
    init=..., xs=...)``), the forward's inputs its gradients are to be sharded like."""
    if isinstance(fn, partial) and "backward" in fn.keywords:
        return fn.keywords["backward"], (fn.keywords.get("init"), fn.keywords.get("xs"))
    return fn, None


def _shard_like(inputs: tuple[Any, Any], grad_init: Any, grad_xs: Any) -> tuple[Any, Any]:
    """torch_xla's ``_backward_shard_alike`` (each gradient sharded like its input, ``shard_as``) applied to the
    loop's results instead of inside its body: there, the forward's inputs were traced into the body, so the loop
    took their whole graph (the batch and the embedding the carry came from, every stacked parameter) as parameters
    and could not be reused in the next step. The stacked gradients are tied to the stacked inputs, which is the
    same constraint as each layer's gradient to that layer's input."""
    from torch.utils._pytree import tree_map
    from torch_xla.distributed.spmd import shard_as

    init, xs = inputs

    def present(grad: Any, value: Any) -> Any:
        return None if grad is None else value

    _, grad_init = shard_as(tree_map(present, grad_init, init), grad_init)
    _, grad_xs = shard_as(tree_map(present, grad_xs, xs), grad_xs)
    return grad_init, grad_xs


def _leaf_key(value: Any) -> Any:
    import torch_xla

    if not isinstance(value, torch.Tensor):
        return value if value is None or isinstance(value, (bool, int, float, str)) else type(value)
    return (tuple(value.shape), value.dtype, torch_xla._XLAC._get_xla_sharding_spec(value))


def _key(trees: tuple[Any, ...], reverse: bool) -> Any:
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(trees)
    return (reverse, spec, tuple(_leaf_key(v) for v in leaves), torch.is_autocast_enabled("xla"),
            torch.get_autocast_dtype("xla"))


def scan_impl_pytree(fn: Any, init: Any, xs: Any, reverse: bool = False) -> Any:
    """torch_xla's ``_scan_impl_pytree`` with the loops of remembered bodies reused."""
    inner, sharded_like = _unwrap(fn)
    loops = _loops(inner)
    if loops is None:
        return patches.torch_xla_scan(fn, init, xs, reverse=reverse)
    carry, ys = _run(inner, loops, init, xs, reverse)
    return (carry, ys) if sharded_like is None else _shard_like(sharded_like, carry, ys)


def _run(fn: Any, loops: dict[Any, _Loop], init: Any, xs: Any, reverse: bool) -> tuple[Any, Any]:
    import torch_xla
    from torch_xla.experimental.scan import tree_flatten_none

    key = _key((init, xs), reverse)
    flat_init, unflatten_carry = tree_flatten_none(init)
    flat_xs, _ = tree_flatten_none(xs)
    loop = loops.get(key)
    if loop is None:
        loop, result = _first(fn, init, xs, reverse, len(flat_init), len(flat_xs))
        if loop is not None:
            loops[key] = loop
        return result
    _HITS[0] += 1
    count = flat_xs[0].size(0)
    device = flat_init[0].device
    buffers = [torch.zeros((count, *shape), device=device, dtype=dtype) for shape, dtype in loop.ys]
    # the iteration counter's start made as torch_xla makes it (a constant of the graph: kept from the first call,
    # it became device data and a parameter, and the step's graph was compiled a second time)
    zero = torch.tensor(0, device=device)
    outputs = torch_xla._XLAC._xla_user_computation(
        "xla::scan", [zero, *flat_init, *flat_xs, *buffers, *loop.hoisted], loop.computation)
    # the loop returns its parameters in order: the counter, the carry, the inputs, the filled buffers, the constants
    carry = outputs[1:1 + loop.carries]
    ys = outputs[1 + loop.carries + len(flat_xs):1 + loop.carries + len(flat_xs) + len(buffers)]
    return unflatten_carry(list(carry)), loop.unflatten_y(list(ys))


def _first(fn: Any, init: Any, xs: Any, reverse: bool, carries: int, inputs: int) -> tuple[_Loop | None, Any]:
    """torch_xla's own lowering, with the loop it builds recorded."""
    from torch_xla.experimental.scan import tree_flatten_none

    built: list[tuple[list[torch.Tensor], Any]] = []
    with patches.recording_scans(built):
        carry, ys = patches.torch_xla_scan(fn, init, xs, reverse=reverse)
    flat_ys, unflatten_y = tree_flatten_none(ys)
    if not built:
        return None, (carry, ys)
    params, computation = built[-1]
    outputs = len(flat_ys)
    if len(params) < 1 + carries + inputs + outputs:
        return None, (carry, ys)
    stacked = params[1 + carries + inputs:1 + carries + inputs + outputs]
    loop = _Loop(computation=computation, ys=[(t.shape[1:], t.dtype) for t in stacked],
                 hoisted=params[1 + carries + inputs + outputs:], carries=carries, unflatten_y=unflatten_y)
    return loop, (carry, ys)
