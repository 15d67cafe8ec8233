"""Batches for the run loop: read from the data source, checked, and put on the device one step ahead.

While step k runs, a background thread reads batch k+1 (``batch(step, seed)``), checks it against the first batch
(:class:`xbridge.data.contract.BatchCheck`) and hands it to the executable's ``put`` (the host-to-device copy, sharded
as planned). The loop then waits only for what is not ready yet; that wait is reported per step as ``data_wait_s``
and is part of the step time. A source's error reaches the loop at the step that needed the batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..backend import Executable
from ..data.contract import BatchCheck


class Feed:
    def __init__(self, source: Any, seed: int, executable: Executable, stop: int, prefetch: bool = True) -> None:
        self.source, self.seed, self.executable, self.stop = source, seed, executable, stop
        self.check = BatchCheck(source, expected_rows=source.batch_size)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xbridge-prefetch") if prefetch else None
        self.ahead: tuple[int, Future] | None = None

    def _load(self, step: int) -> Any:
        return self.executable.put(self.check(self.source.batch(step, self.seed), step))

    def get(self, step: int) -> tuple[Any, float]:
        """Step ``step``'s batch, ready for the executable, and the seconds spent waiting for it; the next batch
        starts loading before this returns."""
        start = time.perf_counter()
        if self.ahead is not None and self.ahead[0] == step:
            batch = self.ahead[1].result()
        else:
            batch = self._load(step)
        self.ahead = None
        if self.pool is not None and step + 1 < self.stop:
            self.ahead = (step + 1, self.pool.submit(self._load, step + 1))
        return batch, time.perf_counter() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
