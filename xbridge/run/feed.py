"""Batches for the run loop, loaded one step ahead.

While step k runs, a background thread loads batch k+1: the executable's ``fetch`` reads it from the data source,
checks it against the first batch (:class:`xbridge.data.source.BatchCheck`) and ``put``s it on the device (the
host-to-device copy, sharded as planned). The loop then waits only for what is not ready yet; that wait is reported
per step as ``data_wait_s`` and is part of the step time. A source's error reaches the loop at the step that needed
the batch. The distributed inductor ranks use the same class to load their own rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Feed:
    def __init__(self, load: Callable[[int], Any], stop: int | None, prefetch: bool = True) -> None:
        self.load, self.stop = load, stop
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xbridge-prefetch") if prefetch else None
        self.ahead: tuple[int, Future] | None = None

    def get(self, step: int) -> tuple[Any, float]:
        """Step ``step``'s batch, ready for the executable, and the seconds spent waiting for it; the next batch
        starts loading before this returns."""
        start = time.perf_counter()
        if self.ahead is not None and self.ahead[0] == step:
            batch = self.ahead[1].result()
        else:
            if self.ahead is not None:      # asked out of order: let the stale load finish first (checks run in order)
                self.ahead[1].exception()
            batch = self.load(step)
        self.ahead = None
        if self.pool is not None and (self.stop is None or step + 1 < self.stop):
            self.ahead = (step + 1, self.pool.submit(self.load, step + 1))
        return batch, time.perf_counter() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
