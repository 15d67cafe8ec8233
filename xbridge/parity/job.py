"""``xbridge parity``: one set of initial weights, one batch stream, every target against the eager reference.

The weights are built once here and handed to every target's process (``xbridge run --init-state``); each target
writes its per-step losses and final state (``--save-state``) and, with ``--bisect``, every module's output on the
first batch (``--trace-modules``). Comparisons use the policy in xbridge/parity/policy.py; the verdicts are a
:class:`~xbridge.parity.record.ParityRecord`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import ConfigError
from ..files import read_npz, write_json, write_npz
from ..ir.program import Program
from ..planner import batch_parts
from ..run.isolated import (
    REFERENCE,
    ChildOptions,
    TargetRun,
    averages_shard_losses,
    resolve_reference,
    resolve_targets,
    run_target,
)
from . import noise as quiet
from . import policy
from .divergence import first_divergence, first_gradient_divergence, split_trace
from .record import (
    DivergentGradient,
    DivergentModule,
    Fp32Reference,
    NoiseFloor,
    NoiseReference,
    ParityCheck,
    ParityRecord,
    ParityReference,
    ParityRow,
    RandomDraw,
    ToleranceRecord,
)


@dataclass
class ParityOptions:
    targets: list[str] | None = None
    steps: int = 20
    devices: int = 1
    precision: str | None = None
    mesh: str | None = None
    bisect: bool = False
    timeout_s: float = 900.0
    jobs: int = 1           # runs at a time (parity compares results, not timings: they may share the machine)
    reference: str = REFERENCE   # the eager target every other is checked against (eager-cuda on a GPU machine)
    rng: str | None = None       # --rng: native or portable (None: the program's own)
    remat: str | None = None     # --remat: none, full or dots (None: the program's own)
    attention: str | None = None  # --attention: the attention kernel forced (None: the program's own)
    processes: int = 1           # --processes: jax targets as this many processes of ``devices`` each

    @property
    def total_devices(self) -> int:
        return self.devices * self.processes

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"--processes must be >= 1, got {self.processes}")
        if self.steps < 2:
            raise ConfigError(f"parity needs --steps >= 2, got {self.steps}")
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ConfigError(f"parity --jobs must be an int >= 1, got {self.jobs!r}")


@dataclass
class TargetOutcome:
    """A target's run and what parity reads back from its files."""

    run: TargetRun
    state: dict[str, np.ndarray] | None = None
    trace: dict[str, np.ndarray] | None = None

    @property
    def losses(self) -> list[float]:
        assert self.run.result is not None
        return self.run.result.losses

    @property
    def matmul_dtypes(self) -> dict[str, int] | None:
        return self.run.result.summary.matmul_dtypes if self.run.result is not None else None

    @property
    def eval_losses(self) -> list[float]:
        assert self.run.result is not None
        return [e.loss for e in self.run.result.evals]


# The files parity writes into --out itself (checked before any run; each run checks its own under runs/, states/).
OUTPUTS = ("parity.json", "initial_weights.npz", "initial_weights_ulp.npz")


def _run(program_ref: str, target: str, options: ParityOptions, out: Path, weights_file: Path,
         precision: str | None, tag: str, census: bool = False) -> TargetOutcome:
    state = out / "states" / f"{tag}.npz"
    trace = out / "traces" / f"{tag}.npz"
    extra = ["--init-state", str(weights_file), "--save-state", str(state)]
    if options.bisect:
        extra += ["--trace-modules", str(trace)]
    if census:
        extra += ["--matmul-dtypes"]
    child = ChildOptions(steps=options.steps, warmup=min(2, options.steps - 1), devices=options.devices,
                         precision=precision, mesh=options.mesh, timeout_s=options.timeout_s, extra=extra,
                         rng=options.rng, remat=options.remat, attention=options.attention,
                         processes=options.processes)
    outcome = TargetOutcome(run_target(program_ref, target, child, out / "runs" / tag))
    if outcome.run.status == "ok":
        outcome.state = read_npz(state, "--save-state")
        outcome.trace = read_npz(trace, "--trace-modules") if options.bisect else None
    return outcome


def random_draws(program: Program) -> list[tuple[str, str]]:
    """(module, op) of each random draw of one training forward, found on the meta device before anything runs
    (xbridge/torch/portable_rng.py); empty when none is found or the model cannot run on the meta device."""

    from ..data.source import checked_batch
    from ..torch import portable_rng as portable
    try:
        return list(portable.random_draws(program, checked_batch(program.data, 0, program.seed)))
    except Exception:  # a model that cannot run shapes-only: nothing is known, parity runs as it would
        return []


def random_cause(draws: list[tuple[str, str]]) -> str:
    """One line: why a program with random draws fails parity under --rng native, and the two ways out."""
    counts: dict[str, int] = {}
    for _, op in draws:
        counts[op] = counts.get(op, 0) + 1
    ops = ", ".join(f"{op} x{n}" for op, n in counts.items())
    modules = list(dict.fromkeys(module for module, _ in draws))
    return (f"each stack draws its own random numbers (--rng native): {ops} in {len(modules)} module(s), the first "
            f"{modules[0]!r}; rerun with --rng portable, or disable dropout for the check")


# A gradient further than this (relative RMS) between the whole batch and its shards is the loss's doing, not fp32
# rounding: a loss that splits exactly (a mean over rows, an xb.LossSum) measured <= 1e-6 (tests/test_loss_sum.py)
SPLIT_GRADIENT_LIMIT = 1e-4


def split_cause(program: Program, weights: dict[str, np.ndarray], devices: int, limit: float) -> str | None:
    """Why a backend that averages per-device losses fails when the loss does not survive a split batch (step 0's
    batch taken whole and as its shards, eval mode, fp32, in this process: the loss values, then the gradients), or
    None when it does."""

    parts = batch_parts(program, devices)
    if parts == 1:
        return None
    from ..torch import loss_split as split
    try:
        found = split.split_losses(program, weights, parts)
    except Exception:  # the check is an explanation: a model it cannot run is left to the verdict alone
        return None
    whole, shards = found.whole, found.split
    gap = abs(shards - whole) / max(abs(whole), 1e-12)
    name, dev = found.worst_gradient()
    if not (gap > limit or dev > SPLIT_GRADIENT_LIMIT):
        return None
    return (f"the loss does not survive a split batch: step 0's batch gives {whole:.6g} whole and {shards:.6g} as "
            f"the mean of its {parts} shards' losses (eval mode, {gap:.1e} apart; the gradient of {name} {dev:.1e} "
            "apart, relative), and this target averages per-device losses as torch DDP does; for a mean over a "
            "count the data decides (masked tokens) return xb.LossSum(total, count), and take a term over the whole "
            "batch (a product of batch means, such as a batch-wide load-balancing loss) per example "
            "(docs/programs.md)")


@dataclass
class Judged:
    """One finished target against the reference: each measure with its limit."""

    loss: policy.Deviation
    params: policy.Deviation
    evals: policy.Deviation | None
    dtypes: str | None          # the matmul dtypes' mismatch, None when they agree

    @property
    def ok(self) -> bool:
        return self.loss.ok and self.params.ok and (self.evals is None or self.evals.ok) and self.dtypes is None

    @property
    def params_alone(self) -> bool:
        """Fails on the parameters while everything else holds: what the reference's own noise may explain."""
        return not self.params.ok and self.loss.ok and (self.evals is None or self.evals.ok) and self.dtypes is None


def _judge(ref: TargetOutcome, row: TargetOutcome, tol: policy.Tolerance, fp32: TargetOutcome | None,
           noise: policy.QuietNoise | None) -> Judged:
    if row.run.result is None or row.state is None or ref.state is None:
        never = policy.Deviation(float("inf"), "no result", 0.0)
        return Judged(never, never, None, None)
    loss = policy.loss_deviation(ref.losses, row.losses, tol, fp32.losses if fp32 else None)
    params = policy.param_deviation(ref.state, row.state, tol, fp32.state if fp32 else None, noise)
    evals = (policy.loss_deviation(ref.eval_losses, row.eval_losses, tol, fp32.eval_losses if fp32 else None)
             if ref.eval_losses else None)
    return Judged(loss, params, evals, policy.matmul_dtype_mismatch(ref.matmul_dtypes, row.matmul_dtypes))


NOISE_RUN = "the reference again from initial weights one ulp apart"


def quiet_noise(program_ref: str, program: Program, reference: str, options: ParityOptions, out: Path,
                weights: dict[str, np.ndarray], progress: Callable[[str, str], None] | None = None,
                ) -> tuple[policy.QuietNoise | None, NoiseReference, TargetOutcome | None]:
    """fp32, when a target fails: the reference's own noise. One more reference run, from initial weights one ulp
    apart (returned when it finished: the noise floor every failing target is held against), and step 0's gradient
    in this process for the elements with no true gradient (xbridge/parity/noise.py; None when it cannot be had)."""
    shifted = write_npz(out / "initial_weights_ulp.npz", quiet.ulp_weights(weights))
    run = _run(program_ref, reference, options, out, shifted, options.precision, "reference-noise")
    if progress:
        progress(f"{reference} (own noise)", run.run.status)
    finished = run if run.run.result is not None and run.state is not None else None
    try:
        masks = quiet.quiet_elements(program, weights)
    except Exception as exc:  # an explanation only: a model it cannot run keeps the bounds as they are
        return None, NoiseReference(NOISE_RUN, run.run.status, {}, f"step 0's gradient: {exc}".splitlines()[0]), \
            finished
    kinds = {name: quiet.kind(name, mask) for name, mask in masks.items()}
    found = {name: kinds[name] or f"{int(mask.sum())} of {mask.size} elements" for name, mask in masks.items()}
    if finished is None:
        return None, NoiseReference(NOISE_RUN, run.run.status, found,
                                    (run.run.error or "").splitlines()[0] or None), None
    assert finished.state is not None
    return policy.QuietNoise(finished.state, masks, kinds), NoiseReference(NOISE_RUN, run.run.status, found), finished


def _may_be_noise(ref: TargetOutcome, row: TargetOutcome, tol: policy.Tolerance) -> bool:
    """A finished target beyond the bounds whose failure the reference's own noise may explain: on its parameters
    alone (the elements with no true gradient), or on a loss it still matched at step 0. A loss beyond the bound at
    step 0 is beyond the floor too (one forward's rounding, far below the bound), so no noise run is made for it."""
    if row.run.result is None or row.state is None:
        return False
    judged = _judge(ref, row, tol, None, None)
    if judged.ok:
        return False
    rel = policy.relative_steps(ref.losses, row.losses)
    return judged.params_alone or (len(rel) == len(ref.losses) and len(rel) > 0 and bool(rel[0] <= tol.loss_rtol))


def noise_floor(ref: TargetOutcome, row: TargetOutcome, tol: policy.Tolerance, own: TargetOutcome,
                noise: policy.QuietNoise | None) -> tuple[Judged, NoiseFloor]:
    """A target beyond the bounds, judged again against the reference's own noise (``own``: the reference from
    initial weights one ulp apart): each deviation within NOISE_FACTOR x the reference's own (policy.py)."""
    judged = _judge(ref, row, tol, own, noise)
    judged = dataclasses.replace(judged, loss=policy.loss_within_own_noise(ref.losses, row.losses, own.losses, tol))
    loss = policy.loss_deviation(ref.losses, own.losses, tol)
    assert ref.state is not None and own.state is not None
    params = policy.tensor_deviations(ref.state, own.state)
    worst = max(params, key=lambda name: params[name], default="")
    return judged, NoiseFloor(judged.ok, loss.value, loss.where, params.get(worst, 0.0), worst)


def parity(program_ref: str, program: Program, options: ParityOptions, out: Path,
           progress: Callable[[str, str], None] | None = None) -> ParityRecord:
    """Run the reference and every target from the same weights; return the verdicts (also written to
    ``out/parity.json``). ``progress(target, status)`` is called as each target's verdict is in."""
    from ..torch.weights import initial_weights

    reference = resolve_reference(options.reference)
    targets = [t for t in resolve_targets(options.targets, reference) if t != reference] or [reference]
    out.mkdir(parents=True, exist_ok=True)
    weights = initial_weights(program)
    weights_file = write_npz(out / "initial_weights.npz", weights)
    census = program.precision.name != "fp32"     # which dtype the matmuls ran in: compared below
    draws = random_draws(program) if program.step.rng == "native" else []     # checked before anything runs
    if draws:
        print(f"note: {program.name}: {random_cause(draws)}", file=sys.stderr)
    # (tag, target, precision, census): every run starts from the same weights file, so they are independent;
    # --jobs N runs N at a time (each its own process), the reference first
    runs = [("reference", reference, options.precision, census)]
    if program.precision.name != "fp32":
        runs.append(("reference-fp32", reference, "fp32", False))
    runs += [(target, target, options.precision, census) for target in targets]
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        pending = {tag: pool.submit(_run, program_ref, target, options, out, weights_file, precision, tag, flag)
                   for tag, target, precision, flag in runs}
        ref = pending["reference"].result()
        if progress:
            progress(f"{reference} (reference)", ref.run.status)
        if ref.run.status != "ok":
            pool.shutdown(wait=True, cancel_futures=True)
            first = (ref.run.error or "").splitlines()[0]
            raise ConfigError(f"the reference {reference} failed, nothing to compare with: {first}")
        fp32 = pending["reference-fp32"].result() if "reference-fp32" in pending else None
        finished = {target: pending[target].result() for target in targets}
    tol = policy.tolerance(program.precision)
    ok32 = fp32 if fp32 is not None and fp32.run.result is not None and fp32.state is not None else None
    noise: policy.QuietNoise | None = None
    noise_record: NoiseReference | None = None
    own: TargetOutcome | None = None
    if fp32 is None and any(_may_be_noise(ref, finished[t], tol) for t in targets):
        noise, noise_record, own = quiet_noise(program_ref, program, reference, options, out, weights, progress)
    rows = []
    checked: dict[str, str | None] = {}
    for target in targets:
        row = finished[target]
        if row.run.result is None or row.state is None:
            entry = ParityRow(target, row.run.status, row.run.devices, "error", error=row.run.error)
        else:
            judged = _judge(ref, row, tol, ok32, noise)
            floor = None
            if not judged.ok and own is not None:     # fp32: within or beyond the reference's own noise
                judged, floor = noise_floor(ref, row, tol, own, noise)
            loss, params, evals, dtypes = judged.loss, judged.params, judged.evals, judged.dtypes
            failing = (np.flatnonzero(~(policy.relative_steps(ref.losses, row.losses) <= loss.limit))
                       if len(row.losses) == len(ref.losses) else np.array([0]))
            check = ParityCheck(
                max_loss_dev=loss.value, max_loss_dev_at=loss.where, loss_limit=loss.limit,
                first_failing_step=int(failing[0]) if failing.size else None,
                max_param_dev=params.value, max_param_dev_at=params.where, param_limit=params.limit,
                losses=row.losses, recompiles=row.run.result.summary.recompiles_after_warmup,
                param_note=params.note or None, noise_floor=floor)
            if census:
                check.census, check.matmul_dtypes, check.matmul_dtypes_mismatch = True, row.matmul_dtypes, dtypes
            if evals is not None:    # the eval losses, under the same limit (index i: the i-th evaluation)
                check.max_eval_loss_dev, check.max_eval_loss_dev_at = evals.value, evals.where.replace("step", "eval")
                check.eval_losses = row.eval_losses
            if fp32 is not None and fp32.run.result is not None:
                check.fp32_max_loss_dev = policy.loss_deviation(fp32.losses, row.losses, tol).value
            if options.bisect and ref.trace is not None and row.trace is not None:
                found = first_divergence(ref.trace, row.trace, tol.loss_rtol)
                check.bisected = True
                check.first_divergent_module = None if found is None else DivergentModule(*found)
                if split_trace(ref.trace)[1] and split_trace(row.trace)[1]:
                    grad = first_gradient_divergence(ref.trace, row.trace, tol.param_rtol)
                    check.gradients_traced = True
                    check.first_divergent_gradient = None if grad is None else DivergentGradient(*grad)
            verdict = "pass" if judged.ok else "FAIL"
            entry = ParityRow(target, row.run.status, row.run.devices, verdict, check=check,
                              versions=row.run.result.versions)
            if draws and verdict == "FAIL":
                entry.cause = random_cause(draws)
            elif verdict == "FAIL" and options.total_devices > 1 and averages_shard_losses(target):
                if "split" not in checked:       # once per parity run, and only when it can explain a failure
                    checked["split"] = split_cause(program, weights, options.total_devices, tol.loss_rtol)
                if checked["split"]:
                    entry.cause = checked["split"]
        rows.append(entry)
        if progress:
            progress(target, entry.status)
    record = ParityRecord(
        xbridge=__version__, program=program.name, config_hash=program.config_hash,
        precision=program.precision.name, steps=options.steps, devices=options.total_devices,
        processes=options.processes, tolerance=ToleranceRecord.of(tol),
        reference=ParityReference(reference, ref.losses, ref.eval_losses, census,
                                  ref.matmul_dtypes if census else None,
                                  ref.run.result.versions if ref.run.result is not None else None),
        reference_fp32=None if fp32 is None else Fp32Reference(fp32.run.status,
                                                               fp32.losses if fp32.run.result else None),
        targets=rows, passed=all(r.verdict == "pass" for r in rows), rng=program.step.rng,
        random_draws=[RandomDraw(module, op) for module, op in draws], reference_noise=noise_record)
    write_json(out / "parity.json", record.to_json())
    return record
