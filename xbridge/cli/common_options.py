"""What several commands share, declared once: the output format (``--format``), the options they take, and
printing a record in that format."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import typer


class Format(StrEnum):
    human = "human"
    json = "json"


# Options several commands take, declared once.
PROGRAM = typer.Argument(..., help="Program file (defines `program = xb.Program(...)`), or FILE.py:NAME.")
TARGET_DEVICES = typer.Option(1, help="Devices for sharded targets (eager always uses 1); with --processes, per "
                              "process.")
TARGET_PROCESSES = typer.Option(1, "--processes", help="jax targets run as P processes of --devices each; the other "
                                "sharded targets run P x --devices in one process (docs/multi-process.md).")
MESH = typer.Option(None, help="Override the program's mesh, e.g. data=-1,model=2.")
PROCESSES = typer.Option(None, "--processes", help="jax targets: spread the run over P processes on this machine, "
                         "--devices each (the mesh spans all of them), or 'cluster': join the job a cluster launcher "
                         "started (docs/multi-process.md).")
FORMAT = typer.Option(Format.human, "--format", help="human: tables for a person; json: one JSON document on stdout.")
TIMEOUT = typer.Option(900.0, help="Seconds before a target's process is stopped and reported as a timeout.")
RNG = typer.Option(None, "--rng", help="Where the forward's random draws (dropout, torch.rand...) come from: "
                   "native (each stack's own generator) or portable (the same bits on every backend). Default: the "
                   "program's StepOptions(rng=...), native unless it says otherwise.")
TENSORBOARD = typer.Option(None, "--tensorboard", help="Write each step's loss, learning rate, step time and tokens/s "
                           "(and eval loss) as TensorBoard event files here; compare: one subfolder per target. "
                           "Needs xbridge[tensorboard].")
PROFILE = typer.Option(None, "--profile", help="Trace steps A..B-1 with the stack's own profiler (torch.profiler, "
                       "jax.profiler, torch_xla's), e.g. steps=5:8; the trace goes under --out DIR/profile and a "
                       "summary of the top operations into the record.")
REMAT = typer.Option(None, "--remat", help="Activation checkpointing of the model's layers: none, full (each layer "
                     "recomputed in the backward pass) or dots (matmul outputs kept). Default: the program's "
                     "StepOptions(remat=...).")
ATTENTION = typer.Option(None, "--attention", help="The kernel every scaled_dot_product_attention call must use: "
                         "auto, math, flash, efficient or cudnn; one the target cannot run is refused. Default: the "
                         "program's StepOptions(attention=...), auto.")
REFERENCE_OPTION = typer.Option("eager-cpu", "--reference", help="The eager target the others are checked against "
                                                                 "(eager-cuda on a GPU machine).")



def emit(record: Any, format: Format, human: Callable[[Any], None]) -> None:
    """``record`` as one JSON document on stdout (a typed record through its ``to_json()``), or ``human(record)``."""
    if format is Format.json:
        print(json.dumps(record.to_json() if hasattr(record, "to_json") else record, indent=2))
    else:
        human(record)
