"""``xbridge compare``: every target in its own ``xbridge run`` subprocess (xbridge/run/isolated.py), then the
derived numbers (throughput, FLOP/s, MFU, memory, loss parity), one table, JSON, CSV and plots."""

from __future__ import annotations

import csv
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import __version__
from ..ir.program import Program
from ..parity import policy
from ..run.isolated import REFERENCE, TargetRun, resolve_reference, resolve_targets, run_target
from .options import CompareOptions
from .peaks import Peak
from .recommend import recommend
from .record import CompareRecord, CompareRow, TargetMetrics

__all__ = ["CSV_FIELDS", "CompareOptions", "TargetMetrics", "attention_text", "compare", "metrics_of", "write_outputs"]


def attention_text(kernels: dict[str, int] | None) -> str | None:
    """``{"flash (CPU)": 4}`` -> ``"flash (CPU) x4"``; no attention call -> ``"-"``; not known -> None."""
    if kernels is None:
        return None
    return ", ".join(f"{kernel} x{calls}" for kernel, calls in kernels.items()) or "-"


def _peak_for(run: TargetRun, dtype: str, cpu_peaks: dict[str, Peak]) -> tuple[Peak, int]:
    from .peaks import known_peak, measure_cpu_gemm

    assert run.result is not None
    if run.result.target.endswith("-cpu"):
        if dtype not in cpu_peaks:
            cpu_peaks[dtype] = measure_cpu_gemm(dtype)
        return cpu_peaks[dtype], 1   # virtual CPU devices share the same cores
    kind = run.result.device_kind
    peak = known_peak(kind, dtype)
    return (peak, run.devices) if peak else (Peak(float("nan"), f"unknown accelerator {kind!r}"), run.devices)


def metrics_of(program: Program, runs: list[TargetRun], flops: int,
               reference: str = REFERENCE) -> dict[str, TargetMetrics]:
    """The derived numbers of every finished target, by target: throughput, FLOP/s, MFU, memory, loss parity
    against ``reference``."""
    ref = next((r.result for r in runs if r.target == reference and r.result is not None), None)
    tol = policy.tolerance(program.precision)
    cpu_peaks: dict[str, Peak] = {}
    out: dict[str, TargetMetrics] = {}
    for run in runs:
        result = run.result
        if result is None:
            continue
        s = result.summary
        peak, devices = _peak_for(run, program.precision.compute, cpu_peaks)
        achieved = flops / s.step_time_median_s
        metrics = TargetMetrics(
            compile_s=s.compile_s, compile_cache=(result.compile_cache or {}).get("state"),
            step_ms_median=s.step_time_median_s * 1e3, step_ms_p10=s.step_time_p10_s * 1e3,
            step_ms_p90=s.step_time_p90_s * 1e3, samples_per_s=s.samples_per_s, tokens_per_s=s.tokens_per_s,
            achieved_tflops=achieved / 1e12, peak_tflops=peak.flops * devices / 1e12,
            mfu=achieved / (peak.flops * devices), peak_source=peak.source,
            peak_host_rss_mib=result.peak_host_rss_bytes / 2 ** 20,
            steps_host_rss_mib=(None if result.host_rss_before_steps_bytes is None else
                                (result.peak_host_rss_bytes - result.host_rss_before_steps_bytes) / 2 ** 20),
            device_peak_mib=result.device_peak_bytes / 2 ** 20 if result.device_peak_bytes else None,
            recompiles=s.recompiles_after_warmup, final_loss=s.final_loss,
            eval_loss=result.final_eval.loss if result.final_eval else None, attention=attention_text(s.attention))
        if ref is not None:
            losses, ref_losses = result.losses, ref.losses
            dev = policy.loss_deviation(ref_losses, losses, tol)
            metrics.max_loss_dev, metrics.max_loss_dev_at, metrics.loss_parity = dev.value, dev.where, dev.ok
            metrics.final_loss_dev = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
        out[run.target] = metrics
    return out


# The files compare writes into --out (checked before the race: none may be a file xbridge did not write).
OUTPUTS = ("results.json", "results.csv", "report.md", "loss_deviation.png", "step_time.png", "mfu.png",
           "initial_weights.npz")
CSV_FIELDS = ["target", "status", "devices", *(f.name for f in dataclasses.fields(TargetMetrics)), "error"]


def write_outputs(out: Path, record: CompareRecord) -> list[Path]:
    from ..files import write_atomic, write_json
    from .plots import draw
    from .report import render

    paths = [write_json(out / "results.json", record.to_json())]

    def write_csv(handle: Any) -> None:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in record.targets:
            writer.writerow({"target": row.target, "status": row.status, "devices": row.devices,
                             "error": row.error_line, **(row.metrics.to_json() if row.metrics else {})})

    paths.append(write_atomic(out / "results.csv", write_csv))
    paths += draw(out, record)
    paths.append(write_atomic(out / "report.md", lambda handle: handle.write(render(record))))
    return paths


def compare(program_ref: str, program: Program, options: CompareOptions, out: Path,
            progress: Callable[[str, str], None] | None = None) -> CompareRecord:
    """Run every target, one at a time (concurrent targets would share the cores and spoil the timings), and
    return the comparison record (``results.json``): one row per target, its run record and derived metrics.
    ``progress(target, status)`` is called as each target ends."""
    from ..run.provenance import provenance
    from ..run.summary import machine
    from ..torch.flops import flops_per_step
    from .estimates import compile_only, estimate
    from .versions import interpreters, version_pairs

    reference = resolve_reference(options.reference)
    compiled = compile_only(options.targets or [], options.topology)
    targets = resolve_targets([t for t in options.targets or [] if t not in compiled] or None, reference)
    out.mkdir(parents=True, exist_ok=True)
    child = options.child()
    where = interpreters(targets)
    shared_init = where if len(set(where.values())) > 1 else None
    if shared_init:
        # Each environment's torch (transformers, timm) may initialise the program's weights its own way from one
        # seed: the targets start from this interpreter's weights instead, so that the loss columns compare the
        # stacks, not two inits. (In one interpreter every target initialises alike, and no weights file is
        # written: a large model's would be its whole size on disk.)
        from ..files import write_npz
        from ..torch.weights import initial_weights

        child.extra += ["--init-state", str(write_npz(out / "initial_weights.npz", initial_weights(program)))]
    runs = []
    for target in targets:
        run = run_target(program_ref, target, child, out / "runs")
        runs.append(run)
        if progress is not None:
            progress(target, run.status)
    estimates = []
    for entry in compiled:
        assert options.topology is not None
        estimates.append(estimate(program_ref, entry, options.topology, options.child(), out / "compiled"))
        if progress is not None:
            progress(entry, estimates[-1].status)
    flops = flops_per_step(program)
    metrics = metrics_of(program, runs, flops, reference)
    rows = []
    for run in runs:
        found = metrics.get(run.target)
        losses = run.result.losses if found is not None and run.result is not None else None
        rows.append(CompareRow(run.target, run.devices, run.command, run.status, run.error, run.result, found, losses))
    record = CompareRecord(
        xbridge=__version__, program=program.name, program_file=program_ref, config=program.config(),
        config_hash=program.config_hash, precision=program.precision.name, machine=machine(),
        measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), options=options, flops_per_step=flops,
        reference=reference, loss_limit=policy.tolerance(program.precision).loss_rtol,
        provenance=provenance(program), targets=rows, estimates=estimates, shared_init=shared_init)
    record.version_pairs = version_pairs(rows, policy.tolerance(program.precision))
    if options.recommend:
        record.recommendation = recommend(rows, reference, options.steps, program.precision.name,
                                          record.loss_limit)
    record.written = [str(p) for p in write_outputs(out, record)]
    return record
