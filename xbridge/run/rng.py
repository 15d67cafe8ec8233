"""``--rng portable`` in the run loop: which rows each batch check labels (the generator's counters) and the
program's loss routed through the portable generator (xbridge/torch/portable_rng.py) before a backend lowers it.
Both are no-ops under ``native``, each stack's own generator."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.program import Program


def rng_rows(program: Program, rows: Any = None) -> np.ndarray | None:
    """The global row index of each example a batch check sees (``rows``: a rank's share; default the whole
    batch), or None under native randomness."""
    if program.step.rng != "portable":
        return None
    return np.arange(program.data.batch_size) if rows is None else np.asarray(rows)


def with_rng(program: Program) -> Program:
    """The program a backend lowers: under portable randomness its loss runs the forward with every random draw
    computed by the portable generator (idempotent)."""
    if program.step.rng != "portable" or getattr(program.loss, "portable_rng", False):
        return program

    # the generator is torch code shared by every backend (all of them run the program's torch forward)
    from ..torch import portable_rng as portable
    return program.replace(loss=portable.portable_loss(program.loss, program.seed))
