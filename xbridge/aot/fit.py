"""``xbridge compile --fit``: what fits a slice, found by compiling candidates with the TPU compiler. First the
cheapest activation checkpointing (none, then dots, then full) under which the program's own batch fits; then, with
it, the largest global batch: doubled until a train step does not fit, then bisected between the last that did and
the first that did not, in steps the mesh and the micro-batches can split."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, PlanError
from ..ir.program import Program
from ..planner import batch_parts
from ..planner import plan as make_plan
from .record import CompiledProgram

REMAT_BY_COST = ("none", "dots", "full")     # recomputation in the backward pass: none, the non-matmuls, all
MAX_DOUBLINGS = 20
RESOLUTION = 8       # bisection stops within 1/8 of the batch found (or one step of the split)


@dataclass
class Tried:
    batch: int
    remat: str
    train: CompiledProgram
    fits: bool


@dataclass
class FitResult:
    tried: list[Tried]
    remat: str | None        # the cheapest setting the program's batch fits under (None: none does)
    batch: int | None        # the largest global batch that fits with it

    def to_json(self, hbm: int) -> dict[str, object]:
        return {"remat": self.remat, "largest_batch": self.batch,
                "tried": [{"batch": t.batch, "remat": t.remat, "fits": t.fits, "need_bytes": t.train.need_bytes,
                           "hbm_bytes": hbm, "compile_s": t.train.compile_s} for t in self.tried]}


def with_batch(program: Program, batch: int) -> Program:
    """``program`` with a global batch of ``batch`` examples (its data source's ``batch_size`` replaced)."""
    if isinstance(batch, bool) or batch < 1:
        raise ConfigError(f"--batch must be a positive number of examples, got {batch}")
    data: Any = program.data
    if not dataclasses.is_dataclass(data) or isinstance(data, type) or not hasattr(data, "batch_size"):
        raise ConfigError(f"--batch: the data source of program {program.name!r} ({type(program.data).__name__}) "
                          "is not a dataclass with a batch_size field; set the batch in the program instead")
    return program.replace(data=dataclasses.replace(data, batch_size=batch))


def search(program: Program, chips: int, hbm: int,
           compile_train: Callable[[Program], CompiledProgram]) -> FitResult:
    """``compile_train(program)``: the train step of ``program`` compiled for the slice."""
    tried: list[Tried] = []

    def fits(batch: int, remat: str) -> bool:
        candidate = with_batch(program, batch).replace(step=dataclasses.replace(program.step, remat=remat))
        make_plan(candidate, chips)     # a batch the mesh cannot split is never a candidate (see unit below)
        train = compile_train(candidate)
        ok = train.fits(hbm)
        tried.append(Tried(batch, remat, train, ok))
        return ok

    base = program.data.batch_size
    remat = next((r for r in REMAT_BY_COST if fits(base, r)), None)
    if remat is None:
        return FitResult(tried, None, None)
    unit = math.lcm(batch_parts(program, chips), program.step.grad_accum)
    good, bad = base, None
    for _ in range(MAX_DOUBLINGS):
        try:
            ok = fits(good * 2, remat)
        except PlanError:
            break
        if not ok:
            bad = good * 2
            break
        good *= 2
    while bad is not None and bad - good > max(unit, good // RESOLUTION):
        middle = good + (bad - good) // 2 // unit * unit
        if middle in (good, bad):
            break
        if fits(middle, remat):
            good = middle
        else:
            bad = middle
    return FitResult(tried, remat, good)
