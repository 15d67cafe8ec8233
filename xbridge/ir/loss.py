"""What a loss may return besides a mean: a sum over items and the number of items (``xb.LossSum``).

A loss that is a mean over a count the data decides (a masked-LM mean over the masked tokens, a mean over the
tokens that are not padding) gives a different number when the batch is split: the mean of each shard's mean is not
the mean of the batch. Returning ``xb.LossSum(total, count)`` instead lets every backend take the same loss however
the batch is split over devices, processes and micro-batches: the global batch's total over its global count,
the normalisation torchtitan and Hugging Face's ``num_items_in_batch`` use. Importing this module imports no ML
framework.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import ProgramError

__all__ = ["LossSum", "check_loss_output", "describe_loss_output"]


class LossSum(NamedTuple):
    """``total``: a 0-d tensor, the sum of the per-item losses of this (micro-)batch; ``count``: a 0-d tensor (or a
    number), how many items (or their total weight) ``total`` sums. The step's loss is the sum of ``total`` over the
    global batch divided by the sum of ``count`` (a batch whose count is 0 contributes nothing)."""

    total: Any
    count: Any


def describe_loss_output(out: Any) -> str | None:
    """Why ``out`` is not a loss value (a 0-d tensor or array, or an ``xb.LossSum`` of two 0-d values), or None."""
    def shape(x: Any) -> tuple | None:
        return tuple(x.shape) if hasattr(x, "shape") else (() if isinstance(x, (int, float)) else None)

    if isinstance(out, LossSum):
        if shape(out.total) != ():
            return f"xb.LossSum whose total has shape {shape(out.total)} (it must be a 0-d tensor)"
        if shape(out.count) != ():
            return f"xb.LossSum whose count has shape {shape(out.count)} (it must be a 0-d tensor or a number)"
        return None
    found = shape(out)
    if found == () and hasattr(out, "shape"):
        return None
    if isinstance(out, (int, float)):
        return (f"a Python {type(out).__name__} (float(), .item() or .tolist() took the value off the tensor, and with "
                "it the gradient: return the tensor itself)")
    return f"shape {found}" if found is not None else type(out).__name__


def check_loss_output(out: Any, program_name: str) -> None:
    """Raise the one error every backend gives for a loss that returned something else than a loss value."""
    problem = describe_loss_output(out)
    if problem is not None:
        raise ProgramError(f"the loss of program {program_name!r} must return a 0-d tensor or "
                           f"xb.LossSum(total, count), got {problem}")
