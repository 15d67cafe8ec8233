"""openxla mode's capture: the loss taken by Dynamo (``torch.compile(backend="openxla")``) as torch_xla's bridge
needs it under SPMD: sharding hints as ops Dynamo can capture, the loss reading copies of its inputs, and the program's
code checked to be importable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xbridge.errors import ConfigError
from xbridge.ir.program import Program


class ShardHint(torch.autograd.Function):
    """``xb.shard`` under Dynamo: torch_xla's ``xla::aot_mark_sharding`` op on the activation and on its gradient.
    ``xs.mark_sharding_with_gradients`` cannot be captured (its ``str(mesh)`` calls numpy's ``tolist``, a graph
    break), so the mesh and spec travel as strings fixed before tracing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
        ctx.mesh, ctx.spec = mesh, spec
        return torch.ops.xla.aot_mark_sharding(x, mesh, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return torch.ops.xla.aot_mark_sharding(grad, ctx.mesh, ctx.spec), None, None


class _LossModule(torch.nn.Module):
    """The program's loss as a module, so ``torch.func.functional_call`` can run it on substitute parameters."""

    def __init__(self, model: torch.nn.Module, loss: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self.model, batch)


def fresh_input_loss(model: torch.nn.Module, loss: Callable) -> Callable:
    """The loss with every parameter and batch array copied inside the captured graph.

    Why (measured, torch_xla 2.9 with SPMD): the Dynamo bridge matches an extracted graph's inputs to the call's
    arguments by tensor id, but under SPMD ``_get_tensors_xla_device_data_node`` re-tags each device buffer with the
    id of the wrapper it returns. Extracting the forward graph therefore hides the identity of every forward input
    from the backward graph extracted next, and the backward treats those it reads (the batch, LayerNorm weights)
    as constants frozen at their step-0 values: the first update is right, every later gradient is wrong (the MLP
    drifted 1.9e-3 from eager at step 2 and 1.7e-1 by step 19, on 1 device too). Reading copies instead makes the
    backward's inputs outputs of the forward graph, which the bridge matches correctly."""
    wrapper = _LossModule(model, loss)

    def loss_of_copies(_model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        params = {name: p.clone() for name, p in wrapper.named_parameters()}
        return torch.func.functional_call(wrapper, params, ({k: v.clone() for k, v in batch.items()},))

    return loss_of_copies


def check_importable(program: Program, model: torch.nn.Module) -> None:
    """Dynamo imports the module of every function it traces (to guard on its globals): code run from a file with
    ``runpy.run_path`` (module ``<run_path>``) fails deep inside Dynamo; say so in one line instead."""
    import sys

    for what, fn in (("loss", program.loss), ("model's forward", type(model).forward)):
        module = getattr(fn, "__globals__", {}).get("__name__")
        if module is not None and module not in sys.modules:
            raise ConfigError(f"--xla-mode openxla: the program's {what} comes from module {module!r}, which Dynamo "
                              "cannot import (code run with runpy.run_path?); load program files with "
                              "xbridge.program_file.load_program or a regular import")
