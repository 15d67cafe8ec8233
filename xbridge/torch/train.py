"""The train step in PyTorch, shared by the torch-based backends (eager, inductor, xla).

Importing this module imports torch: the core never imports it, backends do when they lower.

Precision semantics (the same on every backend):
- parameters are stored in ``precision.params``, and the optimizer updates them in that dtype;
- when ``compute`` differs from ``params``, the forward pass and the loss run under autocast to ``compute``;
- floating batch arrays reach the loss in ``precision.params``;
- the model's floating outputs are cast to ``precision.output`` before the loss, and the loss is taken in float32;
- ``loss_scale="dynamic"`` uses torch.amp.GradScaler (fp16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from xbridge.contract import Executable
from xbridge.ir.loss import LossSum, check_loss_output
from xbridge.ir.optim import SGD, AdamW
from xbridge.ir.precision import Precision
from xbridge.ir.program import Program

from .model_setup import build_model, exact_fp32, tied_groups, torch_dtype
from .seeding import training_seed
from .weights import tensor_to_numpy, to_numpy_state

if TYPE_CHECKING:
    from .layer_stacks import StackedParams

__all__ = ["TorchTrainState", "TrainStep", "batch_to_torch", "build_model", "compute_context", "exact_fp32",
           "tensor_to_numpy", "tied_groups", "to_numpy_state", "torch_dtype"]


def make_optimizer(program: Program, params: list[torch.nn.Parameter], on_device: bool = False,
                   foreach: bool = False) -> torch.optim.Optimizer:
    """torch.optim from the spec, every hyperparameter passed.

    ``on_device``: the learning rate and Adam's step count live in device tensors (``capturable``), so a traced
    backend (torch_xla) sees the same graph every step instead of new Python constants. The lr tensor is marked
    requires_grad only so that torch.optim.SGD takes its tensor path (``addcmul_``) instead of turning it into a
    Python number (a host sync); nothing differentiates through it.

    ``foreach``: torch.optim's multi-tensor update. Under torch.compile it traces to a much smaller graph than the
    per-parameter loop and compiles in a fraction of the time (same arithmetic)."""
    spec = program.optimizer
    params = [p for p in params if p.requires_grad]
    lr: Any = spec.lr
    if on_device:
        lr = torch.tensor(spec.lr, dtype=torch.float32, device=params[0].device, requires_grad=True)
    if isinstance(spec, AdamW):
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, betas=spec.betas, eps=spec.eps,
                                                       weight_decay=spec.weight_decay, amsgrad=False,
                                                       foreach=foreach, maximize=False, capturable=on_device)
    elif isinstance(spec, SGD):
        opt = torch.optim.SGD(params, lr=lr, momentum=spec.momentum, dampening=spec.dampening,
                              weight_decay=spec.weight_decay, nesterov=spec.nesterov, foreach=foreach,
                              maximize=False)
    else:  # Program validation makes this unreachable
        raise TypeError(f"unsupported optimizer spec {spec!r}")
    return opt


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    """What LambdaLR does, without its scheduler: a float, or a fill_ of the device tensor (no new constant)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            with torch.no_grad():
                group["lr"].fill_(value)
        else:
            group["lr"] = value


_SDP_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}


def attention_choice(kernel: str) -> contextlib.AbstractContextManager[Any]:
    """``StepOptions(attention=...)`` on torch: the one ``SDPBackend`` allowed (torch raises when it cannot run)."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDP_BACKENDS[kernel])])


@contextlib.contextmanager
def compute_context(program: Program, device_type: str) -> Iterator[None]:
    """Where the loss runs: the precision's autocast and the attention kernel asked for."""
    precision = program.precision
    with attention_choice(program.step.attention):
        if precision.compute != precision.params:
            with torch.autocast(device_type=device_type, dtype=torch_dtype(precision.compute)):
                yield
        else:
            yield


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode, then each back to the mode it had (a module the user froze in eval stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def loss_parts(out: Any, program: Program) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the loss returned, as float32: (the mean, None), or (the total, the count) of an ``xb.LossSum``."""
    check_loss_output(out, program.name)
    if isinstance(out, LossSum):
        total = out.total.float()
        count = out.count if isinstance(out.count, torch.Tensor) else torch.tensor(out.count)
        return total, count.to(device=total.device, dtype=torch.float32)
    return out.float(), None


def per_item(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``; 1 stands for a count of 0 (a batch without items: its total is 0)."""
    return total / torch.where(count > 0, count, torch.ones_like(count))


def eval_parts(loss_fn: Callable, model: torch.nn.Module, batch: dict[str, torch.Tensor], program: Program,
               device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss of one batch in eval mode, no gradient (``xb.Eval``), as :func:`loss_parts`."""
    with eval_mode(model), torch.no_grad(), compute_context(program, device_type):
        return loss_parts(loss_fn(model, batch), program)


def eval_loss(loss_fn: Callable, model: torch.nn.Module, batch: dict[str, torch.Tensor], program: Program,
              device_type: str) -> torch.Tensor:
    """The loss of one batch in eval mode (an ``xb.LossSum``'s total over its count), as float32."""
    value, count = eval_parts(loss_fn, model, batch, program, device_type)
    return value if count is None else per_item(value, count)


def batch_to_torch(batch: dict[str, np.ndarray], device: torch.device, precision: Precision) -> dict[str, torch.Tensor]:
    """Batch arrays on the device; floating ones in the parameter dtype (as every backend hands them over). Always
    the framework's own copy: a forward that changes its input in place (``x.mul_(2)``) must not change the arrays
    the user's source keeps (a source may hand out views of them), as on jax, where arrays are immutable."""
    dtype = torch_dtype(precision.params)
    out = {}
    for k, v in batch.items():
        floating = np.issubdtype(v.dtype, np.floating)
        out[k] = torch.from_numpy(np.ascontiguousarray(v)).to(device=device, dtype=dtype if floating else None,
                                                               copy=True)
    return out


def split_micro(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    if parts == 1:
        return [batch]
    chunks = {k: torch.chunk(v, parts, dim=0) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


class TrainStep:
    """One optimizer step: the schedule's learning rate, the micro-batch loop with gradient accumulation, loss
    scaling, global-norm clipping and the optimizer update. ``__call__`` returns the mean loss as a 0-d float32
    tensor and the gradients' global L2 norm (unscaled, before clipping: what ``clip_grad_norm_`` returns).

    A loss that returns ``xb.LossSum(total, count)`` is differentiated as its total; the summed gradients are then
    multiplied by :meth:`normaliser` of the summed counts (1 / count in one process), so the step's loss is the
    global total over the global count however the batch is split into micro-batches and ranks."""

    def __init__(self, program: Program, model: torch.nn.Module, device: torch.device, on_device: bool = False,
                 compile: Callable[[Callable], Callable] | None = None, foreach: bool = False,
                 stacked: StackedParams | None = None) -> None:
        """``compile``: a backend's compiler (torch.compile) for the loss (forward, and backward through
        AOTAutograd) and for the optimizer update; ``foreach``: see :func:`make_optimizer`; ``stacked``: the
        scanned layers' parameters held stacked (xbridge/torch/layer_stacks.py), which the optimizer then
        updates as one tensor per layer-relative name."""
        self.program = program
        self.model = model
        self.stacked = stacked if stacked else None
        self.device_type = device.type
        self.updates = 0
        self.count: torch.Tensor | float | None = None     # the last step's global xb.LossSum count (None: a mean)
        torch.manual_seed(training_seed(program.seed))      # --rng native's draws: the same in every run
        self.optimizer = make_optimizer(program, self.parameters(), on_device, foreach)
        if compile:
            # A new train step compiles as a fresh process would (the on-disk caches stay): Dynamo keeps the entries
            # of earlier train steps of this process on the same code (torch.optim's step is one function for
            # every optimizer, the loss the program's), invalidated once their model or optimizer is freed but
            # counted toward its recompile limit (8); past it the step ran uncompiled, where a capturable AdamW on
            # the CPU fails (measured: the 9th inductor run of one program in one process)
            from torch import _dynamo

            _dynamo.reset_code_caches()
        self.loss_fn = compile(program.loss) if compile else program.loss
        self.optimizer_step = compile(self.optimizer.step) if compile else self.optimizer.step
        self.random_factories: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        if program.step.rng == "portable":
            from .portable_rng import factories

            self.random_factories = factories
        scaled = program.precision.loss_scale == "dynamic"
        self.scaler: torch.amp.GradScaler | None = torch.amp.GradScaler(device.type, enabled=scaled) if scaled else None

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        program, model = self.program, self.model
        accum = program.step.grad_accum
        set_lr(self.optimizer, self.lr)
        self.optimizer.zero_grad(set_to_none=True)
        params = self.parameters()
        total = torch.zeros((), dtype=torch.float32, device=params[0].device)
        items: torch.Tensor | None = None
        for micro in split_micro(batch, accum):
            with compute_context(program, self.device_type):
                with self.random_factories():
                    value, count = loss_parts(self.loss_fn(model, micro), program)
            if count is None:
                loss = value / accum
            else:       # a sum: differentiated per row of the micro-batch (the same on every rank), so that its
                rows = len(next(iter(micro.values())))     # gradients stay in a mean's range (fp16's headroom)
                loss = value / rows
                items = count.detach() if items is None else items + count.detach()
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = total + (loss.detach() if count is None else value.detach())
        self.count = None if items is None else self.global_count(items)
        if self.count is not None:       # xb.LossSum: the summed gradients and totals over the global count
            factor = self.normaliser(self.count)
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(factor * rows)
            total = total * factor
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self.gradient_norm()
        if program.step.clip_grad_norm is not None:     # torch's clip_grad_norm_, with the norm computed once
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None],
                                                 program.step.clip_grad_norm, norm, foreach=False)
        if self.scaler:
            self.scaler.step(self.optimizer)   # skipped on overflow; the schedule still advances (torch's AMP recipe)
            self.scaler.update()
        else:
            self.optimizer_step()
        self.updates += 1
        return total, norm

    def global_count(self, count: torch.Tensor) -> torch.Tensor | float:
        """The step's ``xb.LossSum`` count over the global batch, from this process's summed count: the same here;
        a data-parallel backend totals it over its ranks instead."""
        return count

    def normaliser(self, count: torch.Tensor | float) -> torch.Tensor | float:
        """What the gradients of summed totals are multiplied by, given the step's global ``xb.LossSum`` count:
        1 / count (1 for a count of 0)."""
        assert isinstance(count, torch.Tensor)
        return per_item(torch.ones_like(count), count)

    def counted(self) -> dict[str, float]:
        """The last step's global ``xb.LossSum`` count as the run loop reads it (``count``; none for a mean)."""
        return {} if self.count is None else {"count": float(self.count)}

    def gradient_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients (torch's ``get_total_norm``, as ``clip_grad_norm_`` computes it); a
        sharded backend totals it over its ranks instead."""
        return torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None],
                                             2.0, foreach=False)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters under their optimizer names: the model's, with stacked groups under their keys."""
        return self.stacked.named() if self.stacked else list(self.model.named_parameters())

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    @property
    def lr(self) -> float:
        """The learning rate the next step uses (computed on the host: reading a device lr would synchronise)."""
        spec = self.program.optimizer
        return spec.lr * spec.schedule.factor(self.updates)

    # ------------------------------------------------------------------ checkpoint state

    def export_state(self, convert: Callable[[torch.Tensor], Any] = tensor_to_numpy) -> dict[str, Any]:
        """Everything besides the weights that the next step depends on, as numpy under the checkpoint names
        (xbridge/checkpoint/format.py): ``optim/<param>/<key>`` for torch.optim's per-parameter state (floating state in
        float32; ``convert`` makes each: a full array by default), ``loop/updates`` for the schedule's count,
        ``scaler/*`` for GradScaler, ``rng/torch_cpu``."""
        names = {id(p): n for n, p in self.named_parameters()}
        out: dict[str, Any] = {"loop/updates": np.array(self.updates, dtype=np.int64)}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(param)]}/{key}"] = convert(value)
        if self.stacked:
            out = self.stacked.stacks.unstack_entries(out)
        if self.scaler is not None:
            scaler = self.scaler.state_dict()
            out["scaler/scale"] = np.array(scaler["scale"], dtype=np.float32)
            out["scaler/growth_tracker"] = np.array(scaler["_growth_tracker"], dtype=np.int64)
        out["rng/torch_cpu"] = torch.get_rng_state().numpy().copy()
        return out

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        """Load :meth:`export_state`'s arrays (from any backend): optimizer state cast to each parameter's dtype
        and device by torch.optim's own ``load_state_dict``."""
        self.updates = int(state["loop/updates"])
        if self.stacked:
            state = self.stacked.stacks.stack_entries(state, self.stacked.member_shapes(), np.stack)
        params = list(self.optimizer.param_groups[0]["params"])
        names = {id(p): n for n, p in self.named_parameters()}
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for index, param in enumerate(params):
            prefix = f"optim/{names[id(param)]}/"
            # np.ascontiguousarray makes a 0-d array 1-d (Adam's step count): keep the saved shape
            entries = {key[len(prefix):]: torch.from_numpy(np.ascontiguousarray(value).reshape(np.shape(value)))
                       for key, value in state.items() if key.startswith(prefix)}
            if entries:
                per_param[index] = entries
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": per_param, "param_groups": current["param_groups"]})
        if self.scaler is not None and "scaler/scale" in state:
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": float(state["scaler/scale"]),
                                         "_growth_tracker": int(state["scaler/growth_tracker"])})
        if "rng/torch_cpu" in state:
            torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(state["rng/torch_cpu"])))

    def nonfinite_grads(self) -> list[str]:
        """Parameters (eager order) whose gradient from the last step holds a NaN or Inf."""
        if self.stacked:
            return self.stacked.nonfinite()
        return [name for name, p in self.model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


class TorchTrainState(Executable):
    """The checkpoint parts of the Executable contract for executables that hold ``self.train_step`` (a
    :class:`TrainStep`)."""

    train_step: TrainStep

    def training_state(self) -> dict[str, np.ndarray]:
        return self.train_step.export_state()

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        self.train_step.import_state(state)

