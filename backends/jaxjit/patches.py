"""What the jax stack changes in torchax's private API (written for torchax 0.0.13 to 0.0.14.dev20261026;
xbridge/torch/patches.py states the rule and holds the version guard). :func:`apply` runs from
``JaxExecutable``'s construction alone (a run, a compile-ahead), once per process; :func:`undo` puts back everything
it changed.

- autocast: ``torchax.amp.execute_policy``, the hook torchax calls to cast an operator's inputs, is replaced by
  backends/jaxjit/autocast.py's (torch.autocast's policy and state: lists, float64 left alone, the model's own
  ``torch.autocast(enabled=False)`` regions), and the torch functions torchax lowers before they reach aten
  (``F.linear``, attention, einsum, ``aten.convolution``...: ``autocast.FUNCTION_POLICY``) are added to
  ``torchax.amp.autocast_policy`` where it has no entry. torchax offers no public hook for either. Undone: the
  function and the table's entries put back.
- operator lowerings (backends/jaxjit/ops.py says why each): ``aten::_grouped_mm``, a JAX function, in torchax's
  registry (``ops_registry.all_aten_ops``, which an environment copies when it is created) and in the default
  environment's table (``Environment._ops``: its public ``override_op_definition`` makes torch-function entries
  only), unless torchax has its own; BatchNorm's training forms replace torchax's, and ``F.conv1d``/``F.conv3d``
  become ``aten::convolution``, through the public ``Environment.override_op_definition``. Undone: the entries
  that were there put back.
- attention (:func:`routed_attention`): only while a loss is traced, ``F.scaled_dot_product_attention`` and
  ``aten::scaled_dot_product_attention`` go to a JAX kernel (backends/jaxjit/attention.py), written into
  ``Environment._ops`` as JAX functions; the entries that were there are put back after the trace (torchax has no
  public way to remove an override).
- the accelerator: torchax names torch's privateuse1 device ``jax`` and registers a device module whose
  ``is_available()`` is True, so ``torch.accelerator`` takes it for an accelerator with streams. Dynamo asks
  ``torch.accelerator.current_stream()`` when it starts a trace (torch 2.14; 2.9 did not), and torch raises
  "PyTorch is not linked with support for jax devices": inductor in a process that has lowered for jax (a test
  worker, ``check`` over several targets) could not compile. torchax's ``jax`` device has no streams and no device
  guard: ``torchax.device_module.is_available`` says it is not such an accelerator (torchax itself never asks).
  Undone: torchax's function put back.
- custom autograd Functions (:func:`custom_functions`): only while a loss is traced, ``torch.autograd.Function.apply``
  (torch's classmethod, which no torch function mode sees) sends a call with a torchax tensor among its arguments to
  backends/jaxjit/custom_functions.py, which makes the Function's forward and backward a ``jax.custom_vjp`` (torchax
  ran the forward's operators and JAX differentiated them: the user's backward was never called); any other call
  goes to torch's own. Scoped, not applied from ``lower()``: inductor and xla in the same process (Dynamo knows
  ``Function.apply`` by identity) never see it. The classmethod that was there is put back after the trace.
- torch's grad mode (:func:`grad_mode`): torchax ignores ``torch.no_grad()``, so JAX differentiated what a forward
  computes under it (a target, a teacher's output: gradients eager never has), and a parameter changed in place
  there (CLIP's clamped logit scale) had its gradient cut by the change (``clamp_`` passes none where it clamps)
  where torch's leaf keeps it. Only while a loss is traced, the default environment's ``dispatch`` (an instance
  attribute set over the method) does what torch does with grad mode off: an operator's new outputs are
  ``jax.lax.stop_gradient``, and a tensor it changes in place takes its new value with the gradient of the old
  (``old + stop_gradient(new - old)``). The method is the environment's again after the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from xbridge.torch import patches as shared
from xbridge.torch.patches import Patch, PatchSet

AUTOCAST = Patch("torchax.amp.execute_policy and torchax.amp.autocast_policy (torch.autocast's policy)", "torchax",
                 shared.TORCHAX)
OPERATORS = Patch("torchax's operator table (aten::_grouped_mm, BatchNorm's training forms)", "torchax",
                  shared.TORCHAX)
ATTENTION = Patch("torchax's operator table (scaled_dot_product_attention routed to a JAX kernel)", "torchax",
                  shared.TORCHAX)
CUSTOM_FUNCTIONS = Patch("torch.autograd.Function.apply (a Function's forward and backward as a jax.custom_vjp)",
                         "torch", shared.TORCH)
GRAD_MODE = Patch("torchax's Environment.dispatch (torch.no_grad: no gradient through what it computes)", "torchax",
                  shared.TORCHAX)
ACCELERATOR = Patch("torchax.device_module.is_available (torch.accelerator, which Dynamo asks for a stream)",
                    "torchax", shared.TORCHAX)
_PATCHES = PatchSet(AUTOCAST, OPERATORS, ATTENTION)
_ACCELERATOR = PatchSet(ACCELERATOR)


def apply() -> None:
    """Check the pins, then install the autocast hook and the lowerings (once per process)."""
    _PATCHES.apply(_install)
    keep_dynamo_tracing()


def keep_dynamo_tracing() -> None:
    """torchax's ``jax`` device is no accelerator with streams (once per process; the module docstring says why):
    part of :func:`apply`, and what a process that imports torchax by itself and compiles with Dynamo needs too."""
    _ACCELERATOR.apply(lambda patches: patches.set(_device_module(), "is_available", _not_a_streaming_accelerator))


def _device_module() -> Any:
    import torchax.device_module

    return torchax.device_module


def undo() -> None:
    _PATCHES.undo()
    _ACCELERATOR.undo()


def _install(patches: PatchSet) -> None:
    import torchax
    from torchax import amp
    from torchax.ops import ops_registry

    from . import autocast, ops

    for func, policy in autocast.FUNCTION_POLICY.items():
        if func not in amp.autocast_policy:
            patches.set_item(amp.autocast_policy, func, policy)
    patches.set(amp, "execute_policy", autocast.execute_policy)

    env = torchax.default_env()
    for op, impl in ops.jax_lowerings():
        if op in ops_registry.all_aten_ops:      # torchax gained its own: keep it
            continue
        patches.record_item(ops_registry.all_aten_ops, op)
        ops_registry.register_torch_dispatch_op(op, impl, is_jax_function=True, is_user_defined=True)
        patches.set_item(env._ops, op, ops_registry.all_aten_ops[op])
    for packet, impl in ops.torch_replacements():
        for key in (packet, packet.default):
            patches.record_item(env._ops, key)
            env.override_op_definition(key, impl)
    for function, impl in ops.torch_functions():
        patches.record_item(env._ops, function)
        env.override_op_definition(function, impl)


def _not_a_streaming_accelerator() -> bool:
    return False


@contextlib.contextmanager
def routed_attention(impl: Callable[..., Any]) -> Iterator[None]:
    """For the block: torch's attention calls lowered by ``impl``, a JAX function of torch's arguments."""
    shared.check(ATTENTION)
    import torch
    import torch.nn.functional as F
    import torchax
    from torchax.ops import ops_registry

    keys = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention,
            torch.ops.aten.scaled_dot_product_attention.default)
    entries = {key: ops_registry.Operator(key, impl, is_jax_function=True, is_user_defined=True, needs_env=False,
                                          is_view_op=False) for key in keys}
    with shared.replaced(torchax.default_env()._ops, entries, items=True):
        yield


@contextlib.contextmanager
def custom_functions() -> Iterator[None]:
    """For the block: ``torch.autograd.Function.apply`` on torchax tensors is a ``jax.custom_vjp`` of the Function's
    forward and backward (backends/jaxjit/custom_functions.py); torch's classmethod is put back after it."""
    shared.check(CUSTOM_FUNCTIONS)
    import torch

    from . import custom_functions as routed

    owner = torch.autograd.Function
    original = owner.__dict__["apply"]      # the descriptor itself (getattr would give a bound method)

    def torch_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        # bound through the descriptor: a Python classmethod up to torch 2.13, a C classmethod descriptor
        # (_C._FunctionBase.__dict__["apply"], no __func__) from torch 2.14 on; __get__ binds either to cls
        return original.__get__(None, cls)(*args, **kwargs)

    owner.apply = classmethod(routed.routed_apply(torch_apply))
    try:
        yield
    finally:
        owner.apply = original


@contextlib.contextmanager
def grad_mode() -> Iterator[None]:
    """For the block: torchax's default environment honours ``torch.no_grad()`` (the module docstring says how)."""
    shared.check(GRAD_MODE)
    import jax
    import jax.numpy as jnp
    import torch
    import torchax
    from torch.utils import _pytree as torch_pytree
    from torchax.tensor import Tensor

    env = torchax.default_env()
    dispatch = env.dispatch         # the bound method

    def honouring_grad_mode(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return dispatch(func, types, args, kwargs)
        given = [t for t in torch_pytree.tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        before = [t._elem for t in given]
        result = dispatch(func, types, args, kwargs)
        for tensor, old in zip(given, before):
            new = tensor._elem
            if new is not old and jnp.issubdtype(new.dtype, jnp.inexact) and new.shape == old.shape:
                tensor._elem = old + jax.lax.stop_gradient(new - old)
        seen = {id(t) for t in given}
        for out in torch_pytree.tree_flatten(result)[0]:
            if isinstance(out, Tensor) and id(out) not in seen:
                out._elem = jax.lax.stop_gradient(out._elem)
        return result

    env.dispatch = honouring_grad_mode
    try:
        yield
    finally:
        del env.dispatch            # the class's method again
