"""``xb.Eval`` in the run loop: the mean loss over the same ``batches`` batches of the eval data, in eval mode with
no gradient, before the first step, every ``every`` steps and after the last one."""

from __future__ import annotations

import math
import time

from ..contract import Executable
from ..data.source import BatchCheck, tokens_per_example
from ..errors import RunError
from ..ir.program import Eval
from .record import EvalRecord


class Evaluator:
    def __init__(self, spec: Eval, seed: int, executable: Executable, last_step: int) -> None:
        self.spec, self.seed, self.executable, self.last_step = spec, seed, executable, last_step
        self.check = BatchCheck(spec.data, expected_rows=spec.data.batch_size, label="eval batch")
        self.records: list[EvalRecord] = []

    def due(self, done: int) -> bool:
        return done == self.last_step or (self.spec.every is not None and done % self.spec.every == 0)

    def __call__(self, done: int) -> EvalRecord:
        start = time.perf_counter()
        losses = []
        for index in range(self.spec.batches):
            batch = self.executable.put(self.check(self.spec.data.batch(index, self.seed), index))
            losses.append(self.executable.evaluate(batch))
        loss = sum(losses) / len(losses)
        if not math.isfinite(loss):
            raise RunError(f"the eval loss became {loss} after step {done}")
        token_data = tokens_per_example(self.spec.data) > 1
        record = EvalRecord(done, loss, math.exp(min(loss, 700.0)) if token_data else None, self.spec.batches,
                            time.perf_counter() - start)
        self.records.append(record)
        return record
