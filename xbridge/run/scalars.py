"""``--tensorboard DIR``: each step's scalars as TensorBoard event files, written while the run goes (open them with
``tensorboard --logdir DIR``). tensorboardX writes them: it is small (pure Python over protobuf) where the
``tensorboard`` package brings its web server along; install it with ``pip install 'xbridge[tensorboard]'``.

Per step (the step index as in ``run.json``): ``train/loss``, ``train/lr``, ``train/grad_norm`` (the gradients'
global L2 norm before clipping), ``time/step_ms``, ``time/tokens_per_s``,
``time/data_wait_ms`` where the backend reports it; per evaluation ``eval/loss`` (and ``eval/perplexity`` for token
data) at the number of completed steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..errors import RunError
from .record import EvalRecord, StepRecord

__all__ = ["Scalars", "check_available"]


def check_available() -> None:
    """Before anything runs: the package that writes the event files is there."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise RunError("--tensorboard needs the package 'tensorboardX', which is not installed: "
                       "pip install 'xbridge[tensorboard]'")


class Scalars:
    def __init__(self, directory: Path, tokens_per_step: int) -> None:
        from tensorboardX import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.writer: Any = SummaryWriter(logdir=str(directory), flush_secs=10)
        self.tokens_per_step = tokens_per_step

    def step(self, record: StepRecord) -> None:
        add = self.writer.add_scalar
        add("train/loss", record.loss, record.step)
        for key in ("lr", "grad_norm"):
            if key in record.metrics:
                add(f"train/{key}", record.metrics[key], record.step)
        add("time/step_ms", record.time_s * 1e3, record.step)
        if record.time_s > 0:
            add("time/tokens_per_s", self.tokens_per_step / record.time_s, record.step)
        if "data_wait_s" in record.metrics:
            add("time/data_wait_ms", record.metrics["data_wait_s"] * 1e3, record.step)

    def eval(self, record: EvalRecord) -> None:
        self.writer.add_scalar("eval/loss", record.loss, record.step)
        if record.perplexity is not None:
            self.writer.add_scalar("eval/perplexity", record.perplexity, record.step)

    def close(self) -> None:
        self.writer.close()
