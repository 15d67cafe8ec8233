"""``xbridge compile``: the programs ``run`` would build, compiled for a TPU slice by the TPU compiler on this
machine (xbridge/aot/); per chip, memory against HBM, FLOPs, collectives and a roofline bound, as tables or JSON;
``--fit`` searches the remat setting and the largest batch that fit."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..files import check_writable, claim
from .backend_flags import parse_backend_flags
from .common_options import ATTENTION, FORMAT, MESH, PROGRAM, REMAT, RNG, Format
from .program_overrides import load_with_overrides

TOPOLOGY = typer.Option(..., "--topology", help="The TPU slice: a Cloud TPU name (v5e-8, v6e-16, v5p-128, v4-8; v4 "
                        "and v5p names count TensorCores, two a chip) or JAX's GENERATION:SHAPE (v5e:2x4).")


def compile_command(
    ctx: typer.Context,
    program: str = PROGRAM,
    backend: str = typer.Option("jax-tpu", "--backend", "-b", help="The target to compile for (jax-tpu)."),
    topology: str = TOPOLOGY,
    precision: str | None = typer.Option(None, help="Override the precision: fp32, bf16-mixed, bf16-true, "
                                                    "fp16-mixed or params=...,compute=...,output=..."),
    seed: int | None = typer.Option(None, help="Override the program's seed (batch 0 gives the input shapes)."),
    batch: int | None = typer.Option(None, "--batch", help="Override the program's global batch size."),
    rng: str | None = RNG,
    remat: str | None = REMAT,
    attention: str | None = ATTENTION,
    mesh: str | None = MESH,
    dump: Path | None = typer.Option(None, help="Write each program's StableHLO and the TPU compiler's optimised "
                                                "HLO into this directory."),
    fit: bool = typer.Option(False, "--fit", help="Also search, by compiling candidates, the cheapest --remat "
                                                  "and the largest global batch that fit the chips' HBM."),
    out: Path | None = typer.Option(None, help="Directory to write compile.json into."),
    format: Format = FORMAT,
) -> None:
    """Compile a program for a TPU slice on this machine (no TPU needed): per chip, the bytes against HBM and
    whether it fits, FLOPs, collectives, a roofline step-time bound and the MFU ceiling (estimates). Backend
    options (e.g. --sharding-mode) as for run."""
    from ..aot.environment import prepare_process
    from .environment_command import run_elsewhere
    from .run_command import COMMAND_LINE

    run_elsewhere(COMMAND_LINE, backend)   # xla-tpu: where torch_xla is installed
    prepare_process()           # before anything imports jax
    from ..aot.compile import compile_program
    from ..aot.topology import parse_topology
    from ..files import write_json
    from .compile_tables import print_compile, print_fit

    slice_ = parse_topology(topology)
    backend_options = parse_backend_flags(ctx)
    prog = load_with_overrides(program, precision, seed, mesh, rng, remat, attention)
    if batch is not None:
        from ..aot.fit import with_batch

        prog = with_batch(prog, batch)
    if dump is not None:
        check_writable(dump, "--dump")
    if out is not None:
        check_writable(out, "--out", ("compile.json",))
        claim(out, "--out")
    report = compile_program(prog, backend, slice_, backend_options, dump)
    document = report.to_json()
    found = None
    if fit:
        from ..aot.compile import compile_train
        from ..aot.fit import search

        found = search(prog, slice_.chips, slice_.chip.hbm_bytes,
                       lambda candidate: compile_train(candidate, backend, slice_, backend_options))
        document["fit"] = found.to_json(slice_.chip.hbm_bytes)
    if out is not None:
        write_json(out / "compile.json", document)
    if format is Format.json:
        print(json.dumps(document, indent=2))
    else:
        print_compile(report)
        if found is not None:
            print_fit(found, slice_.chip.hbm_bytes)
