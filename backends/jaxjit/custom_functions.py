"""A user's ``torch.autograd.Function`` on jax: its forward and its backward become one ``jax.custom_vjp``, so the
gradient JAX takes through it is the one the user wrote (a straight-through estimator's identity, a gradient
reversal's ``-lambda * grad``), not JAX's derivative of the forward's operators (round's is zero almost everywhere).

torchax 0.0.13 has no hook for it: ``Function.apply`` is no torch function (no ``__torch_function__`` sees it), so
torchax ran the forward's operators and ``jax.grad`` differentiated them, the backward never called. While a loss is
traced, backends/jaxjit/patches.py (:func:`~.patches.custom_functions`) routes ``torch.autograd.Function.apply`` here
when an argument is a torchax tensor (anything else goes to torch's own ``apply``):

- the tensor arguments are the custom_vjp's inputs, every other argument is closed over (static, as torch gives it
  no gradient); torchax's generator key goes in as a value, and out when the forward drew (stochastic rounding), so
  that no tracer of the custom_vjp's trace stays in torchax's environment;
- fwd runs the user's ``forward(ctx, *args)`` (or ``forward(*args)`` then ``setup_context(ctx, inputs, output)``)
  on torchax tensors with a :class:`FunctionContext`; the residuals are the tensors the ctx holds (saved with
  ``save_for_backward`` or set as attributes), its other attributes are closed over;
- bwd runs the user's ``backward(ctx, *grads)`` (``vjp`` when that is what it defines; ``@once_differentiable``
  works as written) and returns a cotangent per tensor input: ``None`` becomes a zero, a gradient of a broadcast
  shape is summed to the input's, an integer input gets none. Outputs marked non-differentiable, integer outputs
  and outputs the loss does not use give the backward zeros (``None`` after ``ctx.set_materialize_grads(False)``);
- with JAX's symbolic zeros, ``ctx.needs_input_grad`` is True for a float tensor input JAX differentiates (torch's
  ``requires_grad``), False for a constant or the batch.

What JAX cannot trace (a backward that reads a value: ``.item()``, ``.tolist()``, ``.numpy()``, ``if tensor:``) is
refused with one line naming the Function's class, file and line (:class:`~xbridge.errors.LoweringError`). The
backward is traced once, abstractly, whenever the forward is traced without differentiation, so that the refusal
comes at init (the executable traces the loss to find the parameters it reads) rather than at the first step.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torchax
from jax.custom_derivatives import SymbolicZero
from torch.utils import _pytree as torch_pytree
from torchax.tensor import OperatorNotFound
from torchax.tensor import Tensor as TorchaxTensor
from torchax.view import View

from xbridge.errors import LoweringError

# what JAX raises when traced code needs a value (TracerBoolConversionError is a ConcretizationTypeError)
_VALUE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                 jax.errors.TracerArrayConversionError, jax.errors.NonConcreteBooleanIndexError)


def routed_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Function.apply`` (the function under torch's classmethod, ``original``) for :func:`~.patches.
    custom_functions`: a custom_vjp when an argument is a torchax tensor, torch's own otherwise."""
    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not any(_is_traced(x) for x in torch_pytree.tree_leaves(args)):
            return original(cls, *args, **kwargs)       # torch's (with keywords: its TypeError, as in eager)
        return call(cls, args, kwargs)
    return apply


def _is_traced(x: Any) -> bool:
    return isinstance(x, (TorchaxTensor, View))


def _has_setup_context(cls: type) -> bool:
    return cls.setup_context is not torch.autograd.Function.setup_context    # type: ignore[attr-defined]


def _backward_of(cls: type) -> Callable[..., Any]:
    """What torch's backward node calls: ``vjp`` when the class defines it, else ``backward``."""
    vjp = cls.vjp                                               # type: ignore[attr-defined]
    return vjp if vjp is not torch.autograd.Function.vjp else cls.backward   # type: ignore[attr-defined]


class FunctionContext:
    """The ``ctx`` a Function's forward and backward get on jax: what users use of torch's."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self._xb_to_save: tuple[Any, ...] = ()
        self._xb_non_differentiable: list[Any] = []
        self._xb_materialize = True
        self._xb_dirty = False

    def save_for_backward(self, *tensors: Any) -> None:
        self._xb_to_save = tensors

    def save_for_forward(self, *tensors: Any) -> None:     # forward-mode AD only: nothing to do here
        pass

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self._xb_to_save)

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self._xb_non_differentiable.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        self._xb_materialize = bool(value)

    def mark_dirty(self, *tensors: Any) -> None:
        self._xb_dirty = True

    def state(self) -> dict[str, Any]:
        """What the backward may read: the saved tensors and the user's attributes."""
        return {"saved": self._xb_to_save,
                "attrs": {k: v for k, v in vars(self).items() if not k.startswith("_xb_") and k != "needs_input_grad"}}


def call(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls.apply(*args, **kwargs)`` as a ``jax.custom_vjp`` of the tensor arguments."""
    env = torchax.default_env()
    setup = _has_setup_context(cls)
    if setup:       # as torch's apply: the forward's defaults bound (keyword arguments never get here)
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)      # type: ignore[attr-defined]
        bound.apply_defaults()
        args = tuple(bound.args)
    positions = [i for i, a in enumerate(args) if _is_traced(a)]
    arrays = tuple(env.t2j_iso(args[i]) for i in positions)
    floats = tuple(isinstance(a, torch.Tensor) and (a.dtype.is_floating_point or a.dtype.is_complex) for a in args)
    keyed = env.param.prng is not None
    saved: dict[str, Any] = {}      # filled by each trace of the forward, read by the backward that follows it

    def forward(keys: tuple[Any, ...], arrays: tuple[Any, ...],
                needs: tuple[bool, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
        """(the output arrays, the generator key after, the residuals), the ctx's static part in ``saved``."""
        inputs = list(args)
        for i, a in zip(positions, arrays):
            inputs[i] = env.j2t_iso(a)
        ctx = FunctionContext(needs)
        outer = env.param.prng
        try:
            with _entered(env), torch.no_grad(), _calling(cls, "forward"):
                if keys:
                    env.param.prng = keys[0]
                if setup:
                    out = cls.forward(*inputs)                                  # type: ignore[attr-defined]
                    cls.setup_context(ctx, tuple(inputs), out)                  # type: ignore[attr-defined]
                else:
                    out = cls.forward(ctx, *inputs)                             # type: ignore[attr-defined]
            # the key comes out only when the forward drew (a key left as it was stays the caller's, not an
            # output of this call, which would be a tracer of the caller's trace after it)
            new_keys = (env.param.prng,) if keys and env.param.prng is not keys[0] else ()
        finally:
            env.param.prng = outer
        if ctx._xb_dirty:
            raise LoweringError(f"{_where(cls, 'forward')} changes an input in place (ctx.mark_dirty), which the "
                                "jax backend cannot carry (its tensors are values); return a new tensor instead")
        outs = out if isinstance(out, tuple) else (out,)
        tensor_outs = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        marked = {id(t) for t in ctx._xb_non_differentiable}
        out_arrays = tuple(jnp.asarray(env.t2j_iso(outs[i])) for i in tensor_outs)
        differentiable = tuple(id(outs[i]) not in marked and jnp.issubdtype(a.dtype, jnp.inexact)
                               for i, a in zip(tensor_outs, out_arrays))
        leaves, spec = torch_pytree.tree_flatten(ctx.state())
        held = [i for i, leaf in enumerate(leaves) if _is_traced(leaf)]
        residuals = tuple(jnp.asarray(env.t2j_iso(leaves[i])) for i in held)
        saved.update(spec=spec, leaves=[None if i in held else leaf for i, leaf in enumerate(leaves)], held=held,
                     outs=[None if i in tensor_outs else o for i, o in enumerate(outs)], tensor_outs=tensor_outs,
                     single=not isinstance(out, tuple), differentiable=differentiable,
                     avals=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_arrays],
                     materialize=ctx._xb_materialize, needs=needs)
        return out_arrays, new_keys, residuals

    def backward(residuals: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
        """The user's backward: a cotangent per tensor input (None: zero)."""
        leaves = list(saved["leaves"])
        for i, r in zip(saved["held"], residuals):
            leaves[i] = env.j2t_iso(r)
        state = torch_pytree.tree_unflatten(leaves, saved["spec"])
        ctx = FunctionContext(saved["needs"])
        ctx._xb_to_save = tuple(state["saved"])
        ctx._xb_materialize = saved["materialize"]
        for name, value in state["attrs"].items():
            setattr(ctx, name, value)
        grads: list[Any] = [None] * len(saved["outs"])
        for k, i in enumerate(saved["tensor_outs"]):
            aval, ct = saved["avals"][k], cts[k]
            if saved["differentiable"][k] and ct is not None and not isinstance(ct, SymbolicZero):
                grads[i] = env.j2t_iso(jnp.asarray(ct))
            elif saved["materialize"]:
                grads[i] = env.j2t_iso(jnp.zeros(aval.shape, aval.dtype))
        with _entered(env), torch.no_grad(), _calling(cls, "backward"):
            result = _backward_of(cls)(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) < len(args) or any(g is not None for g in result[len(args):]):
            raise LoweringError(f"{_where(cls, 'backward')} returned an incorrect number of gradients (expected "
                                f"{len(args)}, got {len(result)})")
        out: list[Any] = []
        for i, a in zip(positions, arrays):
            g = result[i]
            if g is None or not jnp.issubdtype(a.dtype, jnp.inexact):
                out.append(None)
                continue
            g = jnp.asarray(env.t2j_iso(g)) if isinstance(g, torch.Tensor) else jnp.asarray(g)
            out.append(_sum_to(g, a.shape).astype(a.dtype))
        return tuple(out)

    def primal(keys: tuple[Any, ...], arrays: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        outs, new_keys, residuals = forward(keys, arrays, floats)
        # traced without differentiation (the executable's first trace, evaluation): trace the backward too,
        # abstractly, so that one it cannot carry is refused now rather than at the first step
        cts = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) if d else None
                    for a, d in zip(saved["avals"], saved["differentiable"]))
        jax.eval_shape(backward, tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in residuals), cts)
        return outs, new_keys

    def fwd(keys: tuple[Any, ...], arrays: tuple[Any, ...]) -> tuple[Any, Any]:
        # symbolic zeros: each input says whether it is differentiated (torch's requires_grad), each cotangent
        # whether it is zero (an output the loss does not use: None after set_materialize_grads(False))
        perturbed = dict(zip(positions, (a.perturbed for a in arrays)))
        needs = tuple(floats[i] and perturbed.get(i, False) for i in range(len(args)))
        outs, new_keys, residuals = forward(tuple(k.value for k in keys), tuple(a.value for a in arrays), needs)
        return (outs, new_keys), residuals

    def bwd(residuals: tuple[Any, ...], cts: tuple[Any, Any]) -> tuple[Any, Any]:
        out_cts, _ = cts
        return tuple(None for _ in keys), backward(residuals, out_cts)

    function = jax.custom_vjp(primal)
    function.defvjp(fwd, bwd, symbolic_zeros=True)
    keys = (env.param.prng,) if keyed else ()
    out_arrays, new_keys = function(keys, arrays)
    if new_keys:
        env.param.prng = new_keys[0]
    outs = list(saved["outs"])
    for i, a in zip(saved["tensor_outs"], out_arrays):
        outs[i] = env.j2t_iso(a)
    return outs[0] if saved["single"] else tuple(outs)


def _sum_to(g: Any, shape: Sequence[int]) -> Any:
    """A gradient of a shape the input broadcasts to, summed to the input's (as torch's engine does)."""
    if tuple(g.shape) == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    if lead < 0:
        return jnp.broadcast_to(g, shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    return jnp.sum(g, axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


@contextlib.contextmanager
def _entered(env: Any) -> Iterator[None]:
    """torchax's environment for the block, unless it is already on (a backward runs after the loss returned)."""
    if env.enabled:
        yield
        return
    with env:
        yield


@contextlib.contextmanager
def _calling(cls: type, method: str) -> Iterator[None]:
    """A value read or an operator torchax lacks, in the Function's ``method``: one line naming it."""
    try:
        yield
    except _VALUE_ERRORS as exc:
        raise LoweringError(f"{_where(cls, method, exc)} reads a traced tensor's value ({type(exc).__name__}: "
                            ".item(), .tolist(), .numpy(), int()/float() or `if tensor:`), which the jax backend "
                            "cannot do: it traces the step once with values unknown; compute it with tensor "
                            "operations (torch.where, clamp, masks) or run the program on eager or "
                            "inductor") from None
    except OperatorNotFound as exc:
        op = str(exc).removeprefix("Operator with name ").removesuffix(" has no lowering")
        raise LoweringError(f"{_where(cls, method, exc)} uses torch operator {op}, which torchax cannot lower; "
                            "rewrite it with supported operators or run the program on another backend") from None


def _where(cls: type, method: str, exc: BaseException | None = None) -> str:
    """``the backward of torch.autograd.Function STE (path/file.py:12)``: the line of the Function's code where
    ``exc`` was raised, else where the method is defined."""
    fn = getattr(cls, method, None)
    fn = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(fn, "__code__", None)
    path, line = (code.co_filename, code.co_firstlineno) if code is not None else ("<unknown>", 0)
    try:
        lines, start = inspect.getsourcelines(cls)
        source = inspect.getsourcefile(cls) or path
    except (OSError, TypeError):
        lines, start, source = [], 0, path
    if exc is not None and exc.__traceback__ is not None:
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if frame.filename == source and start <= (frame.lineno or 0) < start + len(lines):
                path, line = frame.filename, frame.lineno or line
                break
    shown = os.path.relpath(path) if os.path.isabs(path) and not os.path.relpath(path).startswith("..") else path
    return f"the {method} of torch.autograd.Function {cls.__qualname__} ({shown}:{line})"
