"""The heartbeat: a process that an xbridge supervisor started says what it is doing in a file of its own, whose
time is when it last made progress; the supervisor stops the job when no process has moved for :func:`timeout_s`
seconds."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from ..errors import ConfigError

HEARTBEAT = "XBRIDGE_HEARTBEAT"      # the file where a started process says what it is doing (the run loop's steps)
TIMEOUT = "XBRIDGE_DIST_TIMEOUT"     # seconds without progress in any process before the job is stopped (as inductor)


def beat(what: str) -> None:
    """Say what this process is doing now (its file's time is when it last made progress); nothing unless an xbridge
    supervisor started it."""
    path = os.environ.get(HEARTBEAT)
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(what)


@contextlib.contextmanager
def beating(what: str) -> Iterator[None]:
    """While the block runs, say ``what`` again every few seconds: for local work that may outlast the progress
    timeout and cannot wait on another process (compiling a step), so that a long compile is not taken for a hang.
    Nothing unless an xbridge supervisor started this process."""
    if not os.environ.get(HEARTBEAT):
        yield
        return
    done = threading.Event()
    interval = min(5.0, timeout_s() / 4)

    def keep_beating() -> None:
        while not done.wait(interval):
            beat(what)

    beat(what)
    thread = threading.Thread(target=keep_beating, name="xbridge-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT, "600")
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{TIMEOUT}={text!r} must be a number of seconds") from None
