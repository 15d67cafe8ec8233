"""Several processes, one run: ``--processes P`` (P processes started here, on this machine) or ``--processes
cluster`` (this process is one of a job a cluster launcher started: a Slurm step, an Open MPI job, a Cloud TPU pod
slice, a Kubernetes job set). Every process runs the same run loop (SPMD: the same steps, the same compiled
program, each feeding the rows its own devices hold); process 0 writes what the run writes and prints the report,
the others write into a scratch folder of their own that is removed at the end.

This module imports no ML framework: the supervisor that starts and watches the processes runs before any backend
is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError

CLUSTER = "cluster"
# Set by the supervisor in each process it starts: the coordinator (JAX reads this one itself), the count and the
# index. A cluster launcher that sets the three (or JAX's own environments) works the same way.
COORDINATOR, COUNT, INDEX = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
CHILD = "XBRIDGE_PROCESS_CHILD"      # this process was started by an xbridge supervisor
HEARTBEAT = "XBRIDGE_HEARTBEAT"      # the file where a started process says what it is doing (the run loop's steps)
TIMEOUT = "XBRIDGE_DIST_TIMEOUT"     # seconds without progress in any process before the job is stopped (as inductor)
GRACE_S = 5.0      # after one process fails, how long the others get to end on their own before they are killed


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


def must_start(processes: int | str) -> bool:
    """True in the command a user typed with ``--processes P`` (P > 1): it starts the P processes and waits."""
    return isinstance(processes, int) and processes > 1 and CHILD not in os.environ


def follower_outputs(options: Any, scratch: Path) -> Any:
    """A process other than 0: every path the run writes moved under ``scratch`` (the same calls happen in every
    process: a --save-state gathers from all of them; only process 0's files are kept), but the checkpoint
    directory, where every process writes the pieces it holds (xbridge/run/shards.py)."""
    moved = {}
    for name in ("dump", "state_out", "trace_out", "tensorboard", "profile_dir"):
        path = getattr(options, name)
        if path is not None:
            moved[name] = scratch / name / Path(path).name
    return dataclasses.replace(options, **moved)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def last_error(log: Path) -> str | None:
    """The last line of a process's stderr that says what went wrong, or None when it says nothing."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    lines = [line for line in lines if not line.startswith("[Gloo]")]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line:
            return line.removeprefix("error: ")
    return lines[-1] if lines else None


def start(count: int, argv: list[str]) -> int:
    """Start ``count`` processes of ``xbridge argv`` on this machine (coordinator on 127.0.0.1) and wait for them.
    Process 0 prints to this terminal; the others' output goes to log files. When one fails, the rest get
    :data:`GRACE_S` seconds to end on their own (a collective waiting for the dead peer may never return) and are
    then killed. When no process makes progress for :func:`timeout_s` seconds, all are stopped and the one that
    stopped first is named. The exit status: 0; process 0's when it failed (it said why on this terminal);
    otherwise the failed process's 2 (bad input) or 1, with one line naming it."""
    address, limit = f"127.0.0.1:{free_port()}", timeout_s()
    logs = Path(tempfile.mkdtemp(prefix="xbridge-processes-"))
    beats = [logs / f"process{index}.beat" for index in range(count)]
    procs: list[subprocess.Popen] = []
    keep_logs = False
    try:
        started = time.time()
        for index in range(count):
            env = dict(os.environ, **{COORDINATOR: address, COUNT: str(count), INDEX: str(index), CHILD: "1",
                                      HEARTBEAT: str(beats[index])})
            with contextlib.ExitStack() as files:
                out = None if index == 0 else files.enter_context(open(logs / f"process{index}.out", "wb"))
                err = None if index == 0 else files.enter_context(open(logs / f"process{index}.log", "wb"))
                # each in its own process group: a Ctrl-C at the terminal reaches this supervisor alone, which
                # passes exactly one SIGINT to each (a second one would abort the final checkpoint)
                procs.append(subprocess.Popen([sys.executable, "-m", "xbridge", *argv], env=env, stdout=out,
                                              stderr=err, process_group=0, preexec_fn=die_with_parent))
        failed: list[int] = []          # in the order their failures were seen
        deadline: float | None = None
        while any(p.poll() is None for p in procs):
            failed += [i for i, p in enumerate(procs) if p.poll() not in (None, 0) and i not in failed]
            if failed and deadline is None:
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                _kill(procs)
            if not failed:
                last = [b.stat().st_mtime if b.exists() else started for b in beats]
                if time.time() - max(last) > limit:     # nobody moved: the one that stopped first is named
                    stuck = last.index(min(last))
                    doing = beats[stuck].read_text(encoding="utf-8") if beats[stuck].exists() else "starting"
                    _kill(procs)
                    keep_logs = stuck > 0
                    where = f"its log: {logs / f'process{stuck}.log'}" if stuck else "its output is above"
                    print(f"error: process {stuck} of {count} made no progress for {limit:g} s ({TIMEOUT}; it was "
                          f"{doing}), and no process has since; every process was stopped ({where})", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        failed += [i for i, p in enumerate(procs) if p.returncode != 0 and i not in failed]
        if not failed:
            return 0
        if 0 in failed and procs[0].returncode > 0:
            return procs[0].returncode      # process 0 has said what went wrong on this terminal
        index = failed[0]
        code = procs[index].returncode
        said = last_error(logs / f"process{index}.log") if index else None
        keep_logs = index > 0
        where = f"its log: {logs / f'process{index}.log'}" if index else "its output is above"
        print(f"error: process {index} of {count} {describe_exit(code)}{': ' + said if said else ''} ({where})",
              file=sys.stderr)
        return 2 if code == 2 else 1
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        until = time.monotonic() + limit     # each finishes its step and the checkpoint; one that waits longer
        for p in procs:                      # on a peer than the progress timeout is killed (finally)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, until - time.monotonic()))
        return 130
    finally:
        _kill(procs)
        if not keep_logs:
            shutil.rmtree(logs, ignore_errors=True)


def die_with_parent() -> None:
    """Called in a started process (the supervisor's children before they run, inductor's worker ranks): on Linux
    the kernel kills it when its parent dies, however it dies (SIGKILL leaves the parent no time to stop it), so no
    process of a job outlives the command that started it. Elsewhere nothing: the parent's own exits stop them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):       # no prctl in this libc (not Linux)
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


# what gloo's TCP transport says when the process at the other end is gone (jax's CPU collectives, torch's gloo)
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def after_lost_peer(exc: BaseException) -> None:
    """In a process that ``start`` supervises: an error that is a collective failing because a peer process died
    waits for the supervisor to stop this process (it does within :data:`GRACE_S` of the death), so the one line
    the user reads names the process that died, not this consequence. Returns at once otherwise, and after the
    wait if nothing stopped this process (then the error is reported as it is)."""
    if os.environ.get(CHILD) and this_process()[1] > 1 and any(s in str(exc) for s in _LOST_PEER):
        time.sleep(4 * GRACE_S)


def describe_exit(code: int) -> str:
    """A child process's exit status in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
