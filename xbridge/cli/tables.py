"""The commands' output for a person: rich tables on stdout."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..check.record import CheckRecord
from ..compare.record import CompareRecord
from ..compare.versions import describe as describe_pair
from ..compare.versions import frameworks_text
from ..environments import stack_text
from ..parity.policy import NOISE_FACTOR
from ..parity.record import ParityRecord
from ..run.record import RunRecord

console = Console(width=None if sys.stdout.isatty() else 160)


def _over(processes: int) -> str:
    return f" over {processes} processes" if processes > 1 else ""

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_run(result: RunRecord) -> None:
    s = result.summary
    rng = ", portable rng" if result.rng == "portable" else ""
    table = Table(title=f"{escape(result.program)} on {result.target} ({result.precision}{rng}, "
                        f"{result.devices} device(s){_over(result.processes)}, config {result.config_hash})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("first step (compile + run)", _ms(s.compile_s) + (f", {result.compile_cache['state']} compile cache "
                                                           f"({result.compile_cache['hits']} hits, "
                                                           f"{result.compile_cache['misses']} misses)"
                                                           if result.compile_cache else "")),
        *([("compilations", ", ".join(f"{name} {count}" for name, count in result.compile_cache["compiles"].items()))]
          if result.compile_cache and result.compile_cache.get("compiles") else []),
        (f"step time median over {s.timed_steps} steps", _ms(s.step_time_median_s)),
        ("step time p10 / p90", f"{_ms(s.step_time_p10_s)} / {_ms(s.step_time_p90_s)}"),
        ("samples/s", f"{s.samples_per_s:.1f}"),
        ("tokens/s", f"{s.tokens_per_s:.0f}"),
        ("loss first -> final", f"{s.first_loss:.4f} -> {s.final_loss:.4f}"),
        ("recompiles after warm-up", str(s.recompiles_after_warmup)),
    ]
    if s.attention:
        rows.append(("attention kernel", ", ".join(f"{kernel} x{calls}" for kernel, calls in s.attention.items())))
    if s.matmul_dtypes is not None:     # --matmul-dtypes
        rows.append(("matrix products by dtype (forward)",
                     ", ".join(f"{dtype} x{calls}" for dtype, calls in sorted(s.matmul_dtypes.items())) or "none"))
    if result.evals:
        first, last = result.evals[0], result.evals[-1]
        ppl = f" (perplexity {last.perplexity:.2f})" if last.perplexity is not None else ""
        rows.append((f"eval loss step {first.step} -> {last.step} ({last.batches} batches)",
                     f"{first.loss:.4f} -> {last.loss:.4f}{ppl}"))
    if result.data and not result.data.get("reproducible", True):
        rows.append(("data", "not reproducible from the config alone"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for restart in result.restarts:
        console.print(f"restarted after {restart['after_s']} s from step {restart['from_step']} "
                      f"({restart['steps_redone']} step(s) redone): {escape(restart['message'])}")
    if result.resumed_from and not result.restarts:
        changed = f" (config changed: {', '.join(result.config_changes)})" if result.config_changes else ""
        console.print(f"resumed from {escape(result.resumed_from)} at step {result.start_step}{changed}")
    if result.checkpoints:
        console.print(f"checkpoints written: {len(result.checkpoints)}, last {escape(result.checkpoints[-1])}")
    if result.profile:
        print_profile(result.profile)
    if result.written:
        console.print(f"wrote {escape(result.written)}")


def print_profile(profile: dict[str, Any], top: int = 5) -> None:
    """--profile: the trace files and the operations that took the most time over the profiled steps."""
    steps = f"; each step {', '.join(f'{ms:.1f}' for ms in profile['step_ms'])} ms" if profile.get("step_ms") else ""
    console.print(f"profile ({profile['steps']}{steps}): {', '.join(escape(t) for t in profile['traces'])}")
    for op in profile.get("top_ops", [])[:top]:
        console.print(f"  {op['total_ms']:10.2f} ms  x{op['calls']:<5d} {escape(op['name'][:100])}")


def print_backends(rows: list[dict[str, Any]]) -> None:
    table = Table(title="xbridge targets")
    for col in ("target", "environment", "status", "devices", "versions / reason"):
        table.add_column(col)
    for row in rows:
        detail = ", ".join(f"{k} {v}" for k, v in row["versions"].items()) if row["available"] else row["reason"]
        table.add_row(row["target"], row.get("environment", "here"),
                      "[green]available[/]" if row["available"] else "[red]unavailable[/]",
                      "any (virtual)" if row["devices"] is None else str(row["devices"]), escape(detail or ""))
    console.print(table)


def print_environments(rows: list[dict[str, Any]]) -> None:
    table = Table(title="xbridge environments (a target runs here when it can, else in the first that can; "
                        "TARGET@NAME picks one)")
    for col in ("name", "python", "frameworks", "targets"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["name"], escape(f"{row['python']} ({row['python_version']})"),
                      ", ".join(f"{k} {v}" for k, v in row["frameworks"].items()), ", ".join(row["targets"]))
    console.print(table)


def print_inspect(info: dict[str, Any]) -> None:
    plan = info["plan"]
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    console.print(f"program [bold]{escape(info['program'])}[/] (config {info['config_hash']}), precision "
                  f"{info['precision']}")
    console.print(f"mesh {mesh} over {plan['devices']} device(s); batch spec {tuple(plan['batch'])}")
    console.print(f"parameters: {plan['total_params']:,}; bytes per device: {_bytes(plan['bytes_per_device'])}")
    console.print(f"model FLOPs per step (forward + backward, global batch of {info['batch_size']}): "
                  f"{info['flops_per_step'] / 1e9:.3f} GFLOP")
    memory = info.get("memory")
    if memory is not None and memory["activations"] is None:
        console.print(f"memory per device (estimate): parameters {_bytes(memory['params'])} + gradients "
                      f"{_bytes(memory['grads'])} + optimizer state {_bytes(memory['optimizer'])}; activations "
                      f"unknown: {escape(memory['activations_error'])}")
    elif memory is not None:
        recompute = f" + {_bytes(memory['recompute'])} recomputing one layer" if memory["recompute"] else ""
        console.print(f"memory per device (estimate, remat {memory['remat']}): {_bytes(memory['total'])} = parameters "
                      f"{_bytes(memory['params'])} + gradients {_bytes(memory['grads'])} + optimizer state "
                      f"{_bytes(memory['optimizer'])} + activations {_bytes(memory['activations'])}{recompute}; "
                      f"activations {_bytes(memory['activations_math_attention'])} where attention runs as math "
                      "(jax, xla; docs/depth-and-memory.md)")
    table = Table(title="sharding plan")
    for col in ("parameter", "shape", "dtype", "spec", "rule", "shard shape", "bytes/device"):
        table.add_column(col, justify="right" if col == "bytes/device" else "left")
    for p in plan["params"]:
        spec = "(" + ", ".join("None" if e is None else str(e) for e in p["spec"]) + ")"
        table.add_row(escape(p["name"]), str(tuple(p["shape"])), p["dtype"], escape(spec), escape(p["rule"] or "-"),
                      str(tuple(p["shard_shape"])), _bytes(p["shard_bytes"]))
    console.print(table)


def print_compare(record: CompareRecord) -> None:
    table = Table(title=f"{escape(record.program)}: {record.precision}, {record.options.steps} steps "
                        f"({record.options.warmup} warm-up), {record.flops_per_step / 1e9:.2f} GFLOP/step, "
                        f"config {record.config_hash}")
    columns: tuple[str, ...] = ("target", "status", "compile s (cache)", "step ms (p10-p90)", "samples/s", "tokens/s",
                                "TFLOP/s", "MFU", "peak RSS", "recompiles", "attention", "final loss", "max loss dev",
                                "frameworks")
    evaluates = any(row.metrics is not None and row.metrics.eval_loss is not None for row in record.targets)
    if evaluates:
        columns = (*columns, "eval loss")
    for col in columns:   # a target variant (xla-cpu:xla-mode=openxla) wraps rather than being cut short
        table.add_column(col, justify="left" if col in ("target", "status") else "right",
                         overflow="fold" if col == "target" else "ellipsis")
    for row in record.targets:
        if row.status != "ok":
            table.add_row(row.target, f"[red]{row.status}[/]", escape(row.error_line), *[""] * (len(columns) - 3))
            continue
        m = row.finished
        dev = m.max_loss_dev
        dev_text = "-" if dev is None else (f"{dev:.1e}" + ("" if m.loss_parity else " [red]FAIL[/]"))
        cache = f" ({m.compile_cache})" if m.compile_cache else ""
        table.add_row(row.target, "[green]ok[/]", f"{m.compile_s:.2f}{cache}",
                      f"{m.step_ms_median:.1f} ({m.step_ms_p10:.1f}-{m.step_ms_p90:.1f})",
                      f"{m.samples_per_s:.1f}", f"{m.tokens_per_s:.0f}", f"{m.achieved_tflops:.3f}",
                      f"{100 * m.mfu:.1f}%", _bytes(m.peak_host_rss_mib * 2 ** 20), str(m.recompiles),
                      escape(m.attention or "unknown"), f"{m.final_loss:.4f}", dev_text, frameworks_text(row),
                      *([f"{m.eval_loss:.4f}" if m.eval_loss is not None else "-"] if evaluates else []))
    console.print(table)
    if record.shared_init:
        from ..compare.report import shared_init_text

        console.print(f"initial weights: this interpreter's, for every target (they ran in several environments: "
                      f"{escape(shared_init_text(record.shared_init))})")
    for pair in record.version_pairs:
        console.print(("" if pair.matches else "[red]") + escape(describe_pair(pair)) + ("" if pair.matches else "[/]"))
    for row in record.targets:       # in full: a table cell cuts a long error short
        if row.status != "ok":
            console.print(f"[red]{escape(row.target)}: {row.status}[/]: {escape(row.error_line)}")
    peaks = {row.finished.peak_source for row in record.targets if row.status == "ok"}
    for source in sorted(peaks):
        console.print(f"peak: {escape(source)}")
    if record.estimates:
        print_estimates(record)
    if record.recommendation is not None:
        advice = record.recommendation
        console.print(f"[bold]recommended: {escape(advice.target or 'none')}[/]: {escape(advice.reason)}")
        if advice.command:
            console.print(f"  {escape(advice.command)}")
    for path in record.written or []:
        console.print(f"wrote {escape(path)}")


def print_estimates(record: CompareRecord) -> None:
    """compare --topology's compile-only rows, in a table of their own: compiled here, never run."""
    table = Table(title=f"compiled for TPU topology {record.options.topology} here, not run: ESTIMATES (bytes and "
                        "compile time from the TPU compiler; step time a roofline lower bound, MFU its ceiling)")
    for col in ("target", "status", "chips", "compile s", "needs / chip", "HBM / chip", "fits", "step >= ms",
                "MFU ceiling"):
        table.add_column(col, justify="left" if col in ("target", "status") else "right")
    for e in record.estimates:
        if e.status != "ok":
            table.add_row(e.target, f"[red]{e.status}[/]", escape(e.error_line), *[""] * 6)
            continue
        table.add_row(e.target, "[green]compiled[/]", str(e.chips), f"{e.compile_s:.1f}",
                      _bytes(e.need_bytes or 0), _bytes(e.hbm_bytes or 0), "yes" if e.fits else "[red]no[/]",
                      "-" if e.step_bound_ms is None else f"{e.step_bound_ms:.3f}",
                      "-" if e.mfu_ceiling is None else f"{100 * e.mfu_ceiling:.1f}%")
    console.print(table)


def print_parity(record: ParityRecord) -> None:
    tol = record.tolerance
    table = Table(title=f"parity of {escape(record.program)} ({record.precision}, {record.steps} steps, "
                        f"{record.devices} device(s){_over(record.processes)}) against "
                        f"{record.reference.target}; limits: "
                        f"loss {tol.loss_rtol:g}, params {tol.param_rtol:g}")
    columns = ["target", "verdict", "max loss dev (step)", "first failing step", "max param dev (parameter)"]
    checks = [r.check for r in record.targets if r.check is not None]
    stacks = {stack_text(r.versions) for r in record.targets if r.versions} | {stack_text(record.reference.versions)}
    if len(stacks - {""}) > 1:       # targets ran on different framework versions (environments): say which
        columns.append("frameworks")
    evals = any(c.max_eval_loss_dev is not None for c in checks)
    if evals:
        columns.append("max eval loss dev")
    bisect = any(c.bisected for c in checks)
    fp32 = any(c.fp32_max_loss_dev is not None for c in checks)
    if fp32:
        columns.append("vs fp32 loss dev")
    if bisect:
        columns.append("first divergent module")
    gradients = any(c.gradients_traced for c in checks)
    if gradients:
        columns.append("first divergent gradient (backward)")
    census = any(c.census for c in checks)
    if census:
        columns.append("matmul dtypes (forward)")
    for col in columns:
        table.add_column(col)
    for r in record.targets:
        c = r.check
        if c is None:
            table.add_row(r.target, "[red]error[/]", escape(r.error_line), *[""] * (len(columns) - 3))
            continue
        within = c.noise_floor is not None and c.noise_floor.within
        cells = [r.target, "[yellow]pass (within noise)[/]" if within else "[green]pass[/]" if r.verdict == "pass"
                 else "[red]FAIL[/]",
                 f"{c.max_loss_dev:.2e} ({c.max_loss_dev_at})"
                 + (f", limit {c.loss_limit:.2g}" if c.loss_limit > tol.loss_rtol else ""),
                 "-" if c.first_failing_step is None else str(c.first_failing_step),
                 f"{c.max_param_dev:.2e} ({escape(c.max_param_dev_at)})"
                 + (f", limit {c.param_limit:.2g}" if c.param_limit > tol.param_rtol else "")
                 + (f": {escape(c.param_note)}" if c.param_note else "")]
        if "frameworks" in columns:
            cells.append(stack_text(r.versions))
        if evals:
            cells.append(f"{c.max_eval_loss_dev:.2e} ({c.max_eval_loss_dev_at})" if c.max_eval_loss_dev is not None
                         else "-")
        if fp32:
            cells.append(f"{c.fp32_max_loss_dev if c.fp32_max_loss_dev is not None else float('nan'):.2e}")
        if bisect:
            found = c.first_divergent_module
            cells.append("none" if found is None else f"{escape(found.module)} ({found.deviation:.2e})")
        if gradients:
            grad = c.first_divergent_gradient
            cells.append("-" if not c.gradients_traced else "none" if grad is None else
                         f"{escape(grad.module)} ({escape(grad.parameter)} {grad.deviation:.2e})")
        if census:
            counts = c.matmul_dtypes
            text = "-" if counts is None else ", ".join(f"{n} {d}" for d, n in counts.items())
            cells.append(text + (f" [red]{escape(c.matmul_dtypes_mismatch)}[/]" if c.matmul_dtypes_mismatch
                                 else ""))
        table.add_row(*cells)
    console.print(table)
    if "frameworks" in columns:
        console.print(f"reference {record.reference.target}: {stack_text(record.reference.versions)}")
    for r in record.targets:
        floor = r.check.noise_floor if r.check is not None else None
        if floor is not None:
            own = (f"the reference again from initial weights one ulp apart moves {floor.loss:.2e} ({floor.loss_at}) "
                   f"in the loss and {floor.params:.2e} ({escape(floor.params_at)}) in the parameters")
            console.print(f"{escape(r.target)}: within {NOISE_FACTOR:g}x the reference's own noise ({own}): this "
                          "program amplifies fp32 rounding, so parity cannot tell this target from the reference"
                          if floor.within else f"{escape(r.target)}: [red]FAIL[/] beyond {NOISE_FACTOR:g}x the "
                          f"reference's own noise ({own})")
        if r.cause:
            console.print(f"{escape(r.target)}: [red]FAIL[/] because {escape(r.cause)}")


def print_caches(record: dict[str, Any]) -> None:
    verb = "cleared" if record["cleared"] else "compilation caches"
    table = Table(title=f"{verb} under {escape(record['root'])}")
    for col in ("cache", "files", "size", "what"):
        table.add_column(col, justify="right" if col in ("files", "size") else "left")
    for row in record["caches"]:
        what = row["what"] + (f" [yellow](not used now: {row['overridden_by']} is set)[/]" if row["overridden_by"]
                              else "")
        if row.get("not_a_cache"):
            what += f" [yellow](left, not the framework's: {escape(', '.join(row['not_a_cache']))})[/]"
        table.add_row(row["name"], str(row["files"]), _bytes(row["bytes"]), what)
    console.print(table)
    if not record["caches"]:
        console.print("no cache" + (" to clear" if record["cleared"] else " yet: the first compiled run writes them"))


def print_check(record: CheckRecord) -> None:
    """xbridge check: a verdict per target, then each target's findings (worst first), the constructs and memory."""
    colours = {"runs": "green", "runs-slow": "yellow", "differs": "yellow", "fails": "red"}
    mesh = ", ".join(f"{axis}={size}" for axis, size in record.mesh.items())
    table = Table(title=f"check of {escape(record.program)} ({record.precision}, {record.devices} device(s), mesh "
                        f"{mesh}, rng {record.rng}): {len(record.operators)} operators traced on {record.traced_on}")
    for col in ("target", "verdict", "operators (lowered/decomposed/kernel/host/missing)", "why"):
        table.add_column(col, overflow="fold")
    for row in record.targets:
        counts = "/".join(str(row.operators.get(k, 0)) for k in ("lowered", "decomposed", "kernel", "host", "missing"))
        table.add_row(row.target, f"[{colours[row.verdict]}]{row.verdict}[/]", counts if row.operators else "-",
                      escape(row.summary))
    console.print(table)
    for row in record.targets:
        shown = [f for f in row.findings if f.severity != "note"]
        for finding in shown[:12]:
            console.print(f"{escape(row.target)}: [{'red' if finding.severity == 'fails' else 'yellow'}]"
                          f"{finding.severity}[/] {escape(finding.what)} in {escape(finding.where)}: "
                          f"{escape(finding.why)}")
        if len(shown) > 12:
            console.print(f"{escape(row.target)}: ... {len(shown) - 12} more (--format json lists them all)")
    for fn in record.functions:
        console.print(f"autograd.Function {escape(fn['name'])} at {escape(fn['where'])}")
    for key in record.mutated_inputs:
        console.print(f"the forward changes batch key {key!r} in place (each stack gets its own copy of the batch)")
    if record.unmatched:
        console.print(f"no sharding rule matches {len(record.unmatched)} parameter(s), replicated: "
                      f"{escape(', '.join(record.unmatched[:8]))}{' ...' if len(record.unmatched) > 8 else ''}")
    memory = record.memory
    console.print(f"memory per device (estimate): {_bytes(memory['total'])} (parameters {_bytes(memory['params'])}, "
                  f"gradients {_bytes(memory['grads'])}, optimizer {_bytes(memory['optimizer'])}, activations "
                  f"{_bytes(memory['activations'] or 0)})")
    if record.meta_failure:
        console.print(f"traced on the CPU: the meta device could not run the step ({escape(record.meta_failure)})")
