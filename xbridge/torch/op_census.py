"""What one training step of a program does, seen by torch (``xbridge check``): every aten operator its forward and
backward call, by name and count, with the module and the program's source line of the first call; the user's own
``torch.autograd.Function`` classes; the random draws and whether ``--rng portable`` carries them; the operators
that read a tensor's value on the host (``.item()``, ``if tensor:``) or give a data-dependent shape (``nonzero``,
boolean indexing, ``unique``); and the batch keys the forward changes in place.

The step is run once, shapes only, on the meta device (the model built there, a meta batch); a model the meta device
cannot run (an operator that needs values: ``.item()``, ``nonzero``) runs once on the CPU instead, on its initial
weights and the first batch. A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees the operators after
torch's own composite decompositions, which is what every stack receives (torchax's dispatch, torch_xla's kernels,
AOTAutograd's graph)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from xbridge.ir.program import Program

from . import host_state

__all__ = ["Census", "OpUse", "census", "function_name", "op_name"]

# Operators whose result is a host value (the step waits for the device, and a traced step cannot have it).
HOST_VALUE_OPS = ("aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero")
# Operators whose output shape depends on the values (static-shape compilers cannot trace them).
DATA_DEPENDENT_OPS = ("aten::nonzero", "aten::nonzero_static", "aten::_unique2", "aten::unique_dim",
                      "aten::unique_consecutive", "aten::masked_select", "aten::nonzero_numpy",
                      "aten::repeat_interleave.Tensor")
# Reading rows by a boolean mask (``x[mask]``) gives as many rows as the mask holds; writing through one
# (``x[mask] = v``, aten::index_put_) keeps x's shape, and torchax lowers it with jnp.where (a static shape).
_MASK_READ = "aten::index.Tensor"
_HERE = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.path.dirname(os.__file__))


def op_name(func: Any) -> str:
    """``aten::addmm``, ``aten::sum.dim_IntList``: torch's own name of an operator overload (the default overload
    without a suffix)."""
    return str(func.name())


def function_name(func: Any) -> str:
    """``torch.nn.functional.interpolate``, ``TensorBase.__getitem__``: a torch function's module and qualified name,
    the same for the census and for a stack's table of functions it lowers whole."""
    module = getattr(func, "__module__", None)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{module}.{name}" if module else str(name)


@dataclass
class OpUse:
    """One operator: how often the step calls it, in forward and backward, and where it is called first."""

    name: str
    forward: int = 0
    backward: int = 0
    module: str = ""          # the innermost module running when it was first called ("(backward)": autograd's)
    where: str = ""           # file:line of the program's own code that called it first ("" when none is known)
    in_user_backward: int = 0  # backward calls made by a user autograd.Function's own backward (a stack that
                              # differentiates the forward itself still runs that backward)
    drawn: int = 0            # forward calls made inside a random draw --rng portable carries (there the stack
                              # runs xbridge's portable sampler instead)
    functions: list[str] = dataclasses.field(default_factory=list)   # the outermost torch function of each forward
                              # call (function_name; "" for none): a stack that lowers such a function whole never
                              # sees the operator

    @property
    def at(self) -> str:
        """Module and line: ``blocks.0 (prog.py:35)``."""
        return f"{self.module} ({self.where})" if self.where else self.module


@dataclass
class Census:
    device: str                                   # "meta" or "cpu": where the step was run
    meta_failure: str | None                      # why the meta device could not run it (then: cpu)
    ops: dict[str, OpUse]
    functions: list[dict[str, str]]               # the user's autograd.Function classes: name, where
    draws: list[dict[str, Any]]                   # random draws: module, op, portable (carried by --rng portable)
    mutated_inputs: list[str]                     # batch keys the forward changed in place
    masks: dict[str, OpUse] = dataclasses.field(default_factory=dict)   # boolean-mask indexing, by operator
    host_reads: list[dict[str, str]] = dataclasses.field(default_factory=list)  # host state the forward reads:
                                                  # kind (draw, value, data, stored), what, where
                                                  # (xbridge/torch/host_state.py)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ops"] = [dataclasses.asdict(use) for use in self.ops.values()]
        data["masks"] = [dataclasses.asdict(use) for use in self.masks.values()]
        return data

    def replaced(self, rng: str) -> set[str]:
        """Operators the step calls only inside random draws that ``rng`` (``--rng``) replaces: under ``portable``
        the stacks run xbridge's sampler there, never these."""
        if rng != "portable":
            return set()
        return {name for name, use in self.ops.items() if use.forward and use.drawn == use.forward
                and not use.backward}

    def host_values(self) -> list[OpUse]:
        return [use for name, use in self.ops.items() if name in HOST_VALUE_OPS]

    def data_dependent(self) -> list[OpUse]:
        return [use for name, use in self.ops.items() if name in DATA_DEPENDENT_OPS] + list(self.masks.values())


def _caller() -> str:
    """file:line of the innermost frame outside torch, xbridge and the standard library: the program's (or its
    model library's) own code."""
    return user_line(sys._getframe(2))


def _traced_file(path: str) -> bool:
    """A file outside torch, xbridge and the standard library: the program's (or its model library's)."""
    return not path.startswith(_HERE) and not path.startswith("<")


def user_line(frame: Any) -> str:
    """file:line of the innermost frame from ``frame`` outwards that is outside torch, xbridge and the standard
    library."""
    while frame is not None:
        if _traced_file(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class _Outermost(TorchFunctionMode):
    """The torch function (``torch.cdist``, ``Tensor.__getitem__``, ``F.interpolate``) the program called, while it
    runs: torch disables the mode inside its handler, so the functions it calls in turn are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.current = ""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outer, self.current = self.current, function_name(func)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


class _Ops(TorchDispatchMode):
    def __init__(self, where: list[str], outermost: _Outermost, draws: Any, on_meta: bool,
                 locate: int | None = None) -> None:
        super().__init__()
        self.where = where
        self.outermost = outermost
        self.draws = draws
        self.ops: dict[str, OpUse] = {}
        self.masks: dict[str, OpUse] = {}        # indexing with a boolean mask: a data-dependent shape
        self.backward = False
        self.on_meta = on_meta
        self.signature: host_state.Signature = []    # the forward's calls with their Python numbers
        self.moved: list[str] = []               # the host generators the forward drew from
        self.locate = locate                     # the index of the forward call whose program line is wanted
        self.located = ""
        self.states: tuple[Any, Any] = ((), ())   # the host generators' states before the forward

    def _note(self, table: dict[str, OpUse], name: str) -> None:
        use = table.get(name)
        if use is None:
            module = "(backward)" if self.backward else (self.where[-1] if self.where else "(loss)")
            use = table[name] = OpUse(name, module=module, where="" if self.backward else _caller())
        if self.backward:
            use.backward += 1
            node = torch._C._current_autograd_node()
            forward_cls = getattr(node, "_forward_cls", None) if node is not None else None
            if isinstance(forward_cls, type) and not forward_cls.__module__.startswith("torch."):
                use.in_user_backward += 1
        else:
            use.forward += 1
            use.drawn += self.draws.inside > 0
            if self.outermost.current not in use.functions:
                use.functions.append(self.outermost.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = op_name(func)
        self._note(self.ops, name)
        if not self.backward:
            if len(self.signature) == self.locate:
                self.located = _caller()
            self.signature.append((name, host_state.scalars_of(args, kwargs, self.on_meta)))
        if name == _MASK_READ and any(isinstance(index, torch.Tensor) and index.dtype == torch.bool
                                      for index in (args[1] if len(args) > 1 else ()) or ()):
            self._note(self.masks, f"boolean mask ({name})")     # the kernel finds the rows itself (nonzero)
        return func(*args, **(kwargs or {}))


def _functions(loss: torch.Tensor) -> list[dict[str, str]]:
    """The user's autograd.Function classes in the loss's graph (torch's own are not listed)."""
    seen: dict[type, None] = {}
    stack, visited, alive = [loss.grad_fn], set(), []      # alive: an id is only unique while its node lives
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        alive.append(node)
        forward_cls = getattr(node, "_forward_cls", None)
        if isinstance(forward_cls, type) and not forward_cls.__module__.startswith("torch."):
            seen.setdefault(forward_cls)
        stack.extend(next_node for next_node, _ in node.next_functions)
    out = []
    for cls in seen:
        try:
            where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
        except (OSError, TypeError):
            where = cls.__module__
        out.append({"name": cls.__qualname__, "where": where})
    return out


def _run(program: Program, model: torch.nn.Module, batch: dict[str, torch.Tensor], backward: bool,
         locate: int | None = None) -> tuple[_Ops, list[dict[str, str]], list[str], list[dict[str, Any]]]:
    from .portable_rng import draw_recorder
    from .train import loss_parts, per_item

    model.train()
    where: list[str] = []
    handles = []

    def leave(module: Any, args: Any, output: Any) -> None:     # None: a hook's result would replace the output
        where.pop()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: where.append(name or "(model)")))
        handles.append(module.register_forward_hook(leave))
    versions = {key: value._version for key, value in batch.items()}
    outermost = _Outermost()
    draws = draw_recorder(where)
    recorder = _Ops(where, outermost, draws, next(iter(batch.values())).device.type == "meta", locate)
    torch.manual_seed(program.seed)      # every pass draws the same (torch's generator is not host state)
    recorder.states = host_state.generator_states()
    try:
        # the forward alone needs no autograd graph (a model run on the CPU would hold its activations for nothing)
        with draws, outermost, recorder, torch.set_grad_enabled(backward):
            value, count = loss_parts(program.loss(model, batch), program)
            loss = value if count is None else per_item(value, count)
        recorder.moved = host_state.generators_moved(recorder.states)
        mutated = [key for key, value in batch.items() if value._version != versions[key]]
        functions = _functions(loss) if loss.requires_grad else []
        recorder.backward = True
        with recorder:
            if loss.requires_grad and backward:
                loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    found = [{"module": module, "op": op, "portable": carried}
             for (module, op), carried in zip(draws.found, draws.carried, strict=True)]
    return recorder, functions, mutated, found


def census(program: Program, batch: dict[str, np.ndarray], backward: bool = True) -> Census:
    """One forward and backward of ``program``'s loss on ``batch``: on the meta device, or on the CPU when the meta
    device cannot run it. ``backward=False``: the forward alone. A process that goes on to train on torch_xla must
    not run a backward first: torch's autograd engine sizes its device queues at its first backward, before
    torch_xla's devices exist, and a later XLA backward then fails an internal assert."""
    from .train import batch_to_torch, build_model
    from .weights import initial_weights, meta_model

    failure = None
    with torch.random.fork_rng(devices=[]):
        try:
            from .loss_check import meta_batch

            # floating data in the params dtype, as the backends place it (float64 arrays met an fp32 model's matmul)
            model, tensors = meta_model(program), meta_batch(program, batch)
            saved, kept = _saved(model, tensors), _tensor_attributes(model)
            ops, functions, mutated, draws = _run(program, model, tensors, backward)
            device = "meta"
        except Exception as exc:    # an operator that needs values: once more, on the CPU
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            model = build_model(program, initial_weights(program), torch.device("cpu"))
            tensors = batch_to_torch(batch, torch.device("cpu"), program.precision)
            saved, kept = _saved(model, tensors), _tensor_attributes(model)
            ops, functions, mutated, draws = _run(program, model, tensors, backward)
            device = "cpu"
        reads = _host_reads(program, model, tensors, ops, backward, saved, kept)
    return Census(device, failure, ops.ops, functions, draws, mutated, ops.masks, reads)


def _tensor_attributes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the model's modules hold as plain attributes (not parameters, not buffers), by dotted name."""
    return {f"{name}.{attr}" if name else attr: value for name, module in model.named_modules()
            for attr, value in vars(module).items() if isinstance(value, torch.Tensor)}


def _saved(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's parameters and buffers and the batch, each with a copy, to run a forward again from them."""
    return [(value, value.detach().clone()) for value in (*model.parameters(), *model.buffers(), *tensors.values())]


def _host_reads(program: Program, model: torch.nn.Module, tensors: dict[str, torch.Tensor], first: _Ops,
                backward: bool, saved: list[tuple[torch.Tensor, torch.Tensor]], kept: dict[str, torch.Tensor],
                ) -> list[dict[str, str]]:
    """The host state the forward reads (xbridge/torch/host_state.py): the global generators it drew from (kind
    ``draw``); then two more forwards on the same batch, from the same weights and generators, whose operators must
    receive the same Python numbers (else: ``value``, state the loss keeps itself), and one after the data source
    read batch 1 (else: ``data``, a global the source sets for the step it reads). The first forward is not
    compared: what it builds once (a table cached on a module) is not host state, though a tensor kept on a module
    so is reported (``stored``: a JAX trace's value, which the next trace cannot use); a tensor set on a module at
    every call (kept for inspection) is not."""
    from xbridge.data.source import checked_batch

    def _run_again(restored: bool = False, **kwargs: Any) -> _Ops:    # from the first forward's weights, batch
        if not restored:                                                  # and generators
            _restore_all()
        return _run(program, model, tensors, backward, **kwargs)[0]

    def _restore_all() -> None:
        with torch.no_grad():
            for value, copy in saved:
                value.copy_(copy)
        host_state.restore_states(first.states)

    found = []
    if first.moved:
        _restore_all()
        lines = host_state.locate_draw(lambda: _run_again(restored=True), _traced_file)
        found = [{"kind": "draw", "what": f"a draw from {what}", "where": lines.get(what, "")}
                 for what in first.moved]
    # The first forward may build what later ones reuse (a rotary table cached on the module): compared are the
    # second and third, then the third and one after the data source read batch 1
    first_kept = _tensor_attributes(model)
    warm = _run_again()
    # a tensor the first forward set on a module and the next one read back without setting it: a cache
    found += [{"kind": "stored", "what": "a tensor the forward keeps on its module", "where": f"model.{name}"}
              for name, value in _tensor_attributes(model).items()
              if kept.get(name) is not first_kept.get(name) and value is first_kept.get(name)]
    second = _run_again()             # the loss's own state (a counter it keeps)
    kind = "value"
    if host_state.first_difference(warm.signature, second.signature) is None:
        try:
            checked_batch(program.data, 1, program.seed)     # a global the data source sets for its step
        except Exception:       # a source with one batch: nothing to read in between
            return found
        warm, second, kind = second, _run_again(), "data"
    index = host_state.first_difference(warm.signature, second.signature)
    if index is None:
        return found
    what = host_state.describe_difference(warm.signature, second.signature, index)
    if kind == "data":
        what += " after the data source read the next batch"
    where = _run_again(locate=index).located
    return found + [{"kind": kind, "what": what, "where": where}]


def resolve(name: str) -> Any:
    """The operator overload ``name`` (:func:`op_name`) stands for."""
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), packet_name)
    return getattr(packet, overload or "default")
