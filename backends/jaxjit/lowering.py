"""torch module + loss -> a pure JAX function of (params, buffers, batch), through torchax.

``torchax.interop.JittableModule.functional_call`` runs ``program.loss(model, batch)`` with the module's parameters
replaced by the arrays we pass (torchax tensors wrapping JAX tracers), so the user's loss and model run unchanged.
Compute precision uses torchax's autocast with torch.autocast's policy and state (autocast.py, installed by
patches.py); ``xb.shard`` hints
become ``jax.lax.with_sharding_constraint`` through a handler installed for the trace. A ``torch.autograd.Function``
the loss applies is a ``jax.custom_vjp`` of its forward and backward (custom_functions.py, routed for the trace by
patches.py), so JAX takes the user's gradient through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torchax
from torchax import interop
from torchax.tensor import OperatorNotFound

from xbridge.errors import LoweringError, ProgramError
from xbridge.ir.loss import LossSum, check_loss_output
from xbridge.ir.program import Program
from xbridge.plugin import hints
from xbridge.torch.seeding import training_seed
from xbridge.torch.train import torch_dtype

from . import autocast, patches


class ModuleTracker:
    """Knows which submodule is running, so a failed lowering can name it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        for name, module in model.named_modules():
            module.register_forward_pre_hook(self._enter(name or "<root>"))
            module.register_forward_hook(self._leave)

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "<loss function, outside the model>"


class LoweredLoss:
    """``self(params, buffers, batch) -> (float32 loss, buffers after the forward)``; params keyed by the canonical
    (untied) names. Buffers the forward updates in place (BatchNorm's running statistics and batch counter) come
    back with their new values, in their own dtypes, and so do the parameters it changes in place (under their
    names, beside the buffers: the train step carries them into the update)."""

    def __init__(self, program: Program, model: torch.nn.Module) -> None:
        self.program = program
        self.env = torchax.default_env()
        # --rng native's draws (torchax splits this key at each random op): from the program's seed, not from
        # torch.initial_seed() as torchax seeds it (which torch draws from the operating system)
        self.env.param.prng = jax.random.key(training_seed(program.seed))
        self.module = interop.JittableModule(model, dedup_parameters=True)
        self.tracker = ModuleTracker(model)
        ids = {id(t): name for name, t in self.module.params.items()}
        # every parameter name (tied ones included) -> the name it is trained under; torchax keeps a frozen
        # parameter (requires_grad=False) with the buffers: it is never trained, as torch.optim never updates it
        self.canonical = {n: ids[id(t)] for n, t in model.named_parameters(remove_duplicate=False) if id(t) in ids}
        self.hint: hints.Handler | None = None

    @property
    def param_names(self) -> list[str]:
        return list(self.module.params)

    def __call__(self, params: dict[str, jax.Array], buffers: dict[str, jax.Array], batch: dict[str, jax.Array],
                 key: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
        """The loss of one (micro-)batch: (its value, the item count of an ``xb.LossSum`` or None for a mean, the
        buffers its forward left). ``key``: where ``--rng native`` draws start (a traced key, one per step and
        micro-batch); None: torchax's own key, split while tracing (the same draws at every call of the compiled
        function)."""
        precision = self.program.precision
        p, b, tb = self.env.j2t_iso((params, buffers, batch))
        amp = autocast.compute_autocast(self.env, torch_dtype(precision.compute) if precision.mixed else None)
        keyed = self.env.override_property(prng=key) if key is not None else contextlib.nullcontext()
        try:
            with self.env, amp, keyed, hints.activate(self.hint), patches.custom_functions(), patches.grad_mode():
                loss = self.module.functional_call(self.program.loss, p, b, tb)
        except OperatorNotFound as exc:
            op = str(exc).removeprefix("Operator with name ").removesuffix(" has no lowering")
            raise LoweringError(f"torchax cannot lower torch operator {op} (in module {self.tracker.current!r} of "
                                f"program {self.program.name!r}); rewrite that part of the model with supported "
                                "ops or run it on another backend") from None
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                jax.errors.NonConcreteBooleanIndexError) as exc:
            if not self.tracker.stack:      # the loss function itself, outside the model: the program's mistake
                raise ProgramError(f"the loss of program {self.program.name!r} takes a Python value from a tensor "
                                    f"({type(exc).__name__}: float(), int(), .item() or `if tensor:`) inside the "
                                    "compiled step, which JAX traces without values; keep it a tensor (return the "
                                    "loss tensor itself; torch.where for a choice)") from None
            raise LoweringError(f"module {self.tracker.current!r} of program {self.program.name!r} computes a shape "
                                f"or a Python value from tensor data ({type(exc).__name__}: nonzero, boolean "
                                "indexing, .item() or `if tensor:`) inside the compiled step, which JAX traces "
                                "with static shapes; write it with fixed shapes (masks, torch.where, topk) or run it "
                                "on eager or inductor (transformers' experts: "
                                "model.set_experts_implementation('grouped_mm'))") from None
        except AssertionError as exc:
            if "mixed math" not in str(exc):
                raise
            raise LoweringError(f"module {self.tracker.current!r} of program {self.program.name!r} mixes a CPU "
                                "torch.Tensor with traced tensors (a tensor created in forward without a device?); "
                                "create it on the input's device, e.g. torch.tensor(..., device=x.device), or "
                                "register it as a buffer") from None
        finally:
            self.tracker.stack.clear()
        check_loss_output(loss, self.program.name)
        if isinstance(loss, LossSum):
            value, count = self.env.t2j_iso(loss.total), self.env.t2j_iso(loss.count)
            count = jnp.asarray(count, jnp.float32)
        else:
            value, count = self.env.t2j_iso(loss), None
        # torchax runs an in-place update (running_mean.mul_(...)) by giving the tensor a new array: read them back,
        # and the parameters the forward changed in place (under torch.no_grad: a clamped scale), under their names
        updated = {n: jnp.asarray(self.env.t2j_iso(t)).astype(buffers[n].dtype) for n, t in b.items()}
        for name, tensor in p.items():
            array = self.env.t2j_iso(tensor)
            if name in params and array is not params[name]:
                updated[name] = jnp.asarray(array).astype(params[name].dtype)
        return jnp.asarray(value).astype(jnp.float32), count, updated


def sharding_hint(mesh: jax.sharding.Mesh, axis_sizes: dict[str, int]) -> hints.Handler:
    """``xb.shard`` -> ``with_sharding_constraint`` on the activation (GSPMD mode)."""
    def handle(x: Any, spec: tuple) -> Any:
        hints.check_hint(x, spec, axis_sizes)
        value = interop.jax_view(x)
        constrained = jax.lax.with_sharding_constraint(
            value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
        return interop.torch_view(constrained)
    return handle


@contextlib.contextmanager
def matmul_precision(compute: str) -> Iterator[None]:
    """fp32 means fp32: "highest" matmul precision when compute is float32 (TF32/bf16 passes off on GPU/TPU)."""
    if compute == "float32":
        with jax.default_matmul_precision("highest"):
            yield
    else:
        yield


PRODUCTS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")


def count_products(jaxpr: Any) -> dict[str, int]:
    """Matrix products of a jaxpr, nested ones included (jit, custom_vjp, scan bodies), by their first operand's
    dtype (xbridge/torch/matmul_census.py: the torch backends' count)."""
    counts: dict[str, int] = {}

    def walk(inner: Any) -> None:
        for eqn in inner.eqns:
            if eqn.primitive.name in PRODUCTS:
                name = str(eqn.invars[0].aval.dtype)
                counts[name] = counts.get(name, 0) + 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub.jaxpr)
    walk(jaxpr)
    return dict(sorted(counts.items()))
