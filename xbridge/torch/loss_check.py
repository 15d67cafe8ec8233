"""Checks before compute, the same for every backend: the model has a trainable parameter, and the loss (run once on
the meta device: shapes only, no arithmetic, no memory) is a floating 0-d value or ``xb.LossSum`` that depends on
one. A loss that is detached, or computed without the model, would otherwise train nothing (silently, on a
backend that differentiates whatever it is handed)."""

from __future__ import annotations

import traceback

import numpy as np
import torch

from xbridge.data.source import checked_batch
from xbridge.errors import ProgramError
from xbridge.ir.loss import LossSum, check_loss_output
from xbridge.ir.program import Program
from xbridge.program_file import user_frame

from .train import torch_dtype
from .weights import meta_model

__all__ = ["check_loss"]

# raised in the user's code even on the meta device, so they are the program's mistakes, not the check's limits
_PROGRAM_MISTAKES = (KeyError, NameError, AttributeError, IndexError)


def meta_batch(program: Program, arrays: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """The program's first batch (or ``arrays``, one batch already read) as meta tensors (floating data in the
    params dtype, as the backends place it)."""
    floating = torch_dtype(program.precision.params)
    batch = {}
    for key, value in (checked_batch(program.data, 0, program.seed) if arrays is None else arrays).items():
        dtype = torch.from_numpy(value[:0]).dtype
        batch[key] = torch.empty(value.shape, dtype=floating if dtype.is_floating_point else dtype, device="meta")
    return batch


def check_loss(program: Program) -> int | None:
    """Raise :class:`ProgramError` (or the user's own exception, located by the CLI) when the program cannot train.
    Returns how many ``scaled_dot_product_attention`` calls the forward made (None: the meta device could not run
    it), so that a run of a model without attention skips the attention probe."""
    from .attention import AttentionCalls

    model = meta_model(program)
    if not any(p.requires_grad for p in model.parameters()):
        raise ProgramError(f"the model of program {program.name!r} has no trainable parameter (none with "
                           "requires_grad=True): there is nothing to train")
    model.train()
    calls = AttentionCalls()
    try:
        with calls:
            out = program.loss(model, meta_batch(program))
    except _PROGRAM_MISTAKES as exc:
        found = user_frame(exc)
        if found is not None and found[0] == traceback.extract_tb(exc.__traceback__)[-1]:
            raise       # raised by the user's own line (not by a library it called, which may not know meta tensors)
        return None
    except Exception:   # what the meta device cannot run (.item(), data-dependent shapes): left to the first step
        return None
    check_loss_output(out, program.name)
    value = out.total if isinstance(out, LossSum) else out
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ProgramError(f"the loss of program {program.name!r} must be a floating tensor, got {kind}")
    if not value.requires_grad:
        raise ProgramError(f"the loss of program {program.name!r} does not depend on any trainable parameter (is it "
                           "detached, computed under torch.no_grad(), or from the batch alone?): nothing would train")
    return calls.count
