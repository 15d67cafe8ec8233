"""``xbridge compile``'s output for a person: per chip, each compiled program's memory against HBM, its cost and
collectives, the roofline estimate; ``--fit``'s candidates."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..aot.fit import FitResult
from ..aot.record import TRAIN, CompileReport
from .tables import _bytes, console


def _maybe_bytes(n: int | None) -> str:
    return "-" if n is None else _bytes(n)


def print_compile(report: CompileReport) -> None:
    topo, chip = report.topology, report.topology.chip
    hbm = chip.hbm_bytes
    mesh = ", ".join(f"{k}={v}" for k, v in report.mesh.items())
    table = Table(title=f"{escape(report.program)} compiled for {report.target} on {topo.asked} ({topo.chips} x "
                        f"{chip.device_kind}, {topo.hosts} host(s); mesh {mesh}; global batch {report.global_batch}; "
                        f"{report.options['precision']}) - per chip, nothing ran on a TPU")
    for column in ("program", "lower s", "compile s", "arguments", "outputs", "donated", "temporaries", "code",
                   "needs", f"HBM {_bytes(hbm)}", "GFLOP", "GB accessed", "kernels"):
        table.add_column(column, justify="left" if column == "program" else "right")
    for p in report.programs:
        need = p.need_bytes
        fits = ("[red]does not fit[/red]" if not p.fits(hbm) else f"fits, {_bytes(hbm - need)} free"
                if need is not None else "-")
        table.add_row(p.name, f"{p.lower_s:.1f}", f"{p.compile_s:.1f}", _maybe_bytes(p.argument_bytes),
                      _maybe_bytes(p.output_bytes), _maybe_bytes(p.alias_bytes), _maybe_bytes(p.temp_bytes),
                      _maybe_bytes(p.code_bytes), _maybe_bytes(need), fits,
                      "-" if p.flops is None else f"{p.flops / 1e9:.2f}",
                      "-" if p.bytes_accessed is None else f"{p.bytes_accessed / 1e9:.3f}", str(p.kernels))
    console.print(table)
    for p in report.programs:
        if p.refused:
            console.print(f"{p.name}: the TPU compiler refused it: {escape(p.refused)}")
    train = next((p for p in report.programs if p.name == TRAIN), None)
    if train is not None and train.collectives:
        console.print("train step collectives per chip: " + ", ".join(
            f"{kind} x{c['count']} ({_bytes(c['bytes'])})" for kind, c in sorted(train.collectives.items())))
    r = report.roofline
    if r is not None:
        mfu = "" if r.mfu_ceiling is None else f", MFU ceiling {r.mfu_ceiling:.1%}"
        console.print(f"estimate (roofline, datasheet peaks {chip.peak_flops / 1e12:.0f} TFLOP/s bf16 and "
                      f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s per chip): train step >= {r.step_s * 1e3:.3f} ms, "
                      f"{r.bound_by} bound{mfu}; FLOPs from {r.flops_source}")
    if report.model_flops:
        console.print(f"model FLOPs per step (xbridge's count, all chips): {report.model_flops / 1e9:.2f} GFLOP")
    console.print(f"versions: {', '.join(f'{k} {v}' for k, v in report.versions.items())}; total "
                  f"{report.total_s:.1f} s")


def print_fit(found: FitResult, hbm: int) -> None:
    table = Table(title="--fit: train steps compiled (per chip)")
    for column in ("remat", "global batch", "needs", f"HBM {_bytes(hbm)}", "compile s"):
        table.add_column(column, justify="left" if column == "remat" else "right")
    for t in found.tried:
        table.add_row(t.remat, str(t.batch), _maybe_bytes(t.train.need_bytes),
                      "fits" if t.fits else "[red]does not fit[/red]", f"{t.train.compile_s:.1f}")
    console.print(table)
    if found.remat is None:
        console.print("the program's batch fits under no --remat setting: use more chips, a smaller batch or a "
                      "lower precision")
    else:
        console.print(f"cheapest remat that fits: {found.remat}; largest global batch found with it: {found.batch}")
