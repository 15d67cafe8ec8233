"""The recommendation after a race (``xbridge compare``, on unless ``--no-recommend``): the fastest target whose losses
pass the parity limit against the reference, at the race's precision; its speed-up over the reference per step, the
step count from which its whole run (compile included) is the shorter one, and the ``xbridge run`` command that runs
it. Made from the compare record alone, so results.json and report.md say the same."""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .record import CompareRow

__all__ = ["Recommendation", "recommend", "run_command"]

# What a compare child gets that a user's own run does not need: where compare keeps its files, the JSON on stdout,
# the race's step count and warm-up, a TensorBoard folder and a profile window of compare's own, and the initial
# weights compare hands targets that run in several environments (the program initialises its own in a run).
_RACE_ONLY = {"--out": 1, "--format": 1, "--steps": 1, "--warmup": 1, "--tensorboard": 1, "--profile": 1,
              "--init-state": 1}


def run_command(child: list[str], target: str) -> str:
    """A compare child's command line as the user types it: ``xbridge run PROG --backend T ...`` with the options
    that made the race (devices, processes, precision, mesh, rng, remat, attention, a variant's options), and
    none of compare's own bookkeeping. ``target``: the row's (``inductor-cpu@xla``): a child in another environment
    was started there with the bare target, and the user, in this one, names the environment."""
    start = child.index("run")
    args, kept = child[start + 1:], []
    index = 0
    while index < len(args):
        if args[index] in _RACE_ONLY:
            index += 1 + _RACE_ONLY[args[index]]
            continue
        kept.append(args[index])
        if args[index] == "--backend" and index + 1 < len(args):
            kept.append(target.partition(":")[0])       # TARGET[@ENV], without a variant's options
            index += 1
        index += 1
    return shlex.join(["xbridge", "run", *kept])


@dataclass
class Recommendation:
    """The target to run (None: no target but the reference passes parity, or the reference did not finish)."""

    target: str | None
    reason: str                         # one sentence: why this target, or why none
    command: str | None = None          # ``xbridge run ...`` for ``target``
    speedup: float | None = None        # the reference's median step time / the target's
    break_even_steps: int | None = None     # from this many steps on, the target's compile + steps take less time
                                            # than the reference's; None when its compile is no longer (or no gain)
    passing: list[str] = dataclasses.field(default_factory=list)    # targets within the parity limit, fastest first
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)   # target -> why it is not a candidate

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Recommendation:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def _total_s(row: CompareRow, steps: int) -> float:
    metrics = row.finished
    return metrics.compile_s + steps * metrics.step_ms_median / 1e3


def _why_not(row: CompareRow, limit: float) -> str | None:
    """Why ``row`` cannot be recommended, or None when it can."""
    if row.metrics is None:
        return f"{row.status}: {row.error_line}" if row.error_line else row.status
    metrics = row.metrics
    if metrics.loss_parity is None:
        return "no reference losses to check it against"
    if not metrics.loss_parity:
        return (f"fails parity: loss off by {metrics.max_loss_dev:.2e} at {metrics.max_loss_dev_at} (limit "
                f"{limit:.0e})")
    if not math.isfinite(metrics.step_ms_median):
        return "no step time"
    return None


def recommend(rows: list[CompareRow], reference: str, steps: int, precision: str, limit: float) -> Recommendation:
    """The fastest target (median step time, the race's steady state) among those whose losses stay within
    ``limit`` of ``reference``'s, all run at ``precision``."""
    ref = next((row for row in rows if row.target == reference), None)
    if ref is None or ref.metrics is None:
        why = "it was not run" if ref is None else (ref.error_line or ref.status)
        return Recommendation(None, f"no recommendation: the reference {reference} did not finish ({why}), so no "
                                    "target's losses could be checked")
    excluded = {row.target: reason for row in rows if (reason := _why_not(row, limit)) is not None}
    passing = sorted((row for row in rows if row.target not in excluded), key=lambda row: row.finished.step_ms_median)
    names = [row.target for row in passing]
    others = [row for row in passing if row.target != reference]
    if not others:
        detail = "; ".join(f"{target} {why}" for target, why in excluded.items()) or "no other target was raced"
        return Recommendation(None, f"no target but the reference {reference} passes parity at {precision} ({detail})",
                              passing=names, excluded=excluded)
    best = passing[0]
    ref_step, best_step = ref.finished.step_ms_median, best.finished.step_ms_median
    if best.target == reference:
        runner = others[0]
        return Recommendation(
            reference, f"the reference {reference} is the fastest at {precision}: {ref_step:.1f} ms a step, against "
                       f"{runner.finished.step_ms_median:.1f} ms for {runner.target}, the fastest target that passes "
                       "parity", run_command(ref.command, ref.target), 1.0, None, names, excluded)
    speedup = ref_step / best_step
    extra_compile = best.finished.compile_s - ref.finished.compile_s
    break_even = math.floor(extra_compile / ((ref_step - best_step) / 1e3)) + 1 if extra_compile > 0 else None
    reason = (f"{best.target} is the fastest target within the parity limit ({limit:.0e}) at {precision}: "
              f"{best_step:.1f} ms a step against {ref_step:.1f} ms on {reference}, {speedup:.2f}x")
    if break_even is not None:
        verdict = (f"so a run of this race's {steps} steps is slower overall on it"
                   if _total_s(best, steps) > _total_s(ref, steps) else f"which this race's {steps} steps repay")
        reason += (f"; its compile takes {extra_compile:.1f} s more ({best.finished.compile_cache or 'cache unknown'}),"
                   f" repaid from {break_even} steps on, {verdict}")
    return Recommendation(best.target, reason, run_command(best.command, best.target), speedup, break_even, names,
                          excluded)
