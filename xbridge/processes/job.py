"""This process's place in a job: the environment a supervisor or a cluster launcher sets, ``--processes``, and
whether (and as which process) this one has joined a job."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

CLUSTER = "cluster"
# Set by the supervisor in each process it starts: the coordinator (JAX reads this one itself), the count and the
# index. A cluster launcher that sets the three (or JAX's own environments) works the same way.
COORDINATOR, COUNT, INDEX = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
CHILD = "XBRIDGE_PROCESS_CHILD"      # this process was started by an xbridge supervisor
JOIN_TIMEOUT = "XBRIDGE_JOIN_TIMEOUT"   # seconds a process waits for the coordinator and the others (default 60)


def wait_for_address(address: str, timeout_s: float) -> str | None:
    """Try to connect to ``HOST:PORT`` until it accepts or ``timeout_s`` passes; None once it accepts, else why not
    (the last error)."""
    import socket
    import time

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{COORDINATOR}={address!r} must be HOST:PORT")
    deadline = time.monotonic() + timeout_s
    why = "nothing answered"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout_s)):
                return None
        except OSError as exc:
            why = exc.strerror or str(exc)
        time.sleep(0.2)
    return why


def join_timeout_s() -> int:
    """How long joining a job may take before it fails with one line (``XBRIDGE_JOIN_TIMEOUT``, default 60 s:
    every process of a job starts within seconds of the others; a coordinator not there by then is not coming)."""
    text = os.environ.get(JOIN_TIMEOUT, "60")
    try:
        seconds = int(text)
    except ValueError:
        seconds = 0
    if seconds < 1:
        raise ConfigError(f"{JOIN_TIMEOUT}={text!r} must be a whole number of seconds >= 1")
    return seconds


_joined = (0, 1)      # (this process's index, the count) once the run loop has joined a job
_joining = False      # this process will join a job: backends must not start their runtime before it has


def joining(value: bool = True) -> None:
    """Say that this process is about to join a job (before any target is resolved): a backend then checks its
    devices after joining, not before (JAX cannot join once its runtime has started)."""
    global _joining
    _joining = value


def is_joining() -> bool:
    return _joining


def joined(index: int, count: int) -> None:
    global _joined
    _joined = (index, count)


def this_process() -> tuple[int, int]:
    """(index, count) of the job this process joined; (0, 1) when it is alone."""
    return _joined


def parse(text: str | None) -> int | str:
    """``--processes``: a count >= 1, or ``cluster``."""
    if text is None:
        return 1
    if text == CLUSTER:
        return CLUSTER
    try:
        count = int(text)
    except ValueError:
        raise ConfigError(f"--processes must be a count >= 1 or {CLUSTER!r}, got {text!r}") from None
    if count < 1:
        raise ConfigError(f"--processes must be a count >= 1 or {CLUSTER!r}, got {count}")
    return count


def environment_job() -> tuple[int, int] | None:
    """(index, count) from the environment a launcher set (``JAX_PROCESS_ID``, ``JAX_NUM_PROCESSES``), or None."""
    index, count = os.environ.get(INDEX), os.environ.get(COUNT)
    if not index or not count:      # unset, or set to nothing
        return None
    try:
        return int(index), int(count)
    except ValueError:
        raise ConfigError(f"{INDEX}={index!r} and {COUNT}={count!r} must be integers") from None


def under_torchrun() -> bool:
    """torchrun (torch.distributed.elastic) started this process: it sets ``RANK`` and ``WORLD_SIZE`` in each."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def must_start(processes: int | str) -> bool:
    """True in the command a user typed with ``--processes P`` (P > 1): it starts the P processes and waits."""
    return isinstance(processes, int) and processes > 1 and CHILD not in os.environ


def follower_outputs(options: Any, scratch: Path) -> Any:
    """A process other than 0: every path the run writes moved under ``scratch`` (the same calls happen in every
    process: a --save-state gathers from all of them; only process 0's files are kept), but the checkpoint
    directory, where every process writes the pieces it holds (xbridge/checkpoint/shards.py)."""
    moved = {}
    for name in ("dump", "state_out", "trace_out", "tensorboard", "profile_dir"):
        path = getattr(options, name)
        if path is not None:
            moved[name] = scratch / name / Path(path).name
    return dataclasses.replace(options, **moved)
