"""Run a check in a forked copy of this process, so that what it does to the program's Python state stays there.

Before step 0 a run checks the program by calling its loss (xbridge/run/prepare.py: the loss's shapes on the meta
device, xbridge/torch/loss_check.py; the operators and constructs of its forward, xbridge/torch/op_census.py) and
reads its first batch. A program with a side effect there (a loss that counts its calls or appends to a list of
logged metrics, a global it changes, a draw from numpy's or Python's generator, a data source that advances an
iterator) would see those calls as steps: its step 0 would be its third call. In a forked child the checks run on
a copy-on-write copy of everything, the result comes back through a pipe, and the child ends with ``os._exit``:
the program's state in this process is as the checks found it, and the loss is called once per step
(docs/programs.md, "How often xbridge calls the loss").

The child runs torch on the meta device (the CPU when the meta device cannot run a forward) and nothing of a
compiler's runtime, so a framework's threads in this process do not matter to it, with one exception: GNU OpenMP
(torch's CPU kernels, MKL's matmul) waits forever in a forked child for the thread team of a parent that used it
(measured: a census on the CPU hung in ``gomp_team_barrier_wait_end``), so the child runs torch on one thread, as
torch's DataLoader workers do; and a child that has not answered in ``TIMEOUT_S`` is ended and the check runs
here instead. Fork is used on Linux; elsewhere
(macOS forbids a forked child much of its system libraries) and under ``XBRIDGE_DEBUG=1`` (a traceback of the
user's code is wanted) the check runs in this process, as it did before."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import ProgramError, RunError, XBridgeError

__all__ = ["call"]

T = TypeVar("T")
TIMEOUT_S = 600.0      # far beyond a meta check of the largest model measured (Llama-3-70B's: seconds)


def _in_this_process() -> bool:
    return (not sys.platform.startswith("linux") or not hasattr(os, "fork")
            or os.environ.get("XBRIDGE_DEBUG", "") not in ("", "0"))


def call(fn: Callable[..., T], *args: Any, fallback: T) -> T:
    """``fn(*args)`` in a forked child: its value, or its exception raised here (the user's own exception as the
    one line the CLI would print for it, a :class:`ProgramError` with its exit code). ``fallback`` when the child
    ends without an answer (killed, crashed)."""
    if _in_this_process():
        return fn(*args)
    _import_before_fork()
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns of fork in a process with threads (JAX's, Gloo's); the child runs none of their code
        warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*os\.fork\(\).*", category=RuntimeWarning)
        pid = os.fork()
    if pid == 0:        # the child: never returns
        os.close(read)
        _child(fn, args, write)
    os.close(write)
    try:
        data = _answer(read)
    except BaseException:       # interrupted here: the child goes too
        _end(pid)
        raise
    if data is None:            # no answer in time: the check runs here
        _end(pid)
        return fn(*args)
    os.waitpid(pid, 0)
    if not data:
        return fallback
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    return value


def _import_before_fork() -> None:
    """Import here what the child's meta forward imports on first use and this process imports later anyway, so that
    it is imported once: torch's decompositions and prims import Dynamo (and sympy) on their first call, as does
    every ``torch.optim`` optimizer's constructor (measured, torch 2.14: 2.5 s in a child on one thread, then 1.1 s
    again here for the optimizer, of a 6.9 s ``xbridge run`` of the MLP). Importing runs no kernel and starts no
    thread (what forking must avoid: the module docstring)."""
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401  (heavy: only where torch is loaded already)


def _answer(read: int) -> bytes | None:
    """Everything the child writes before it ends, or None when it has not ended in TIMEOUT_S."""
    import select
    import time

    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                return None
            chunk = pipe.read(1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _child(fn: Callable[..., Any], args: tuple, write: int) -> None:
    payload: tuple[str, Any]
    try:
        if "torch" in sys.modules:      # GNU OpenMP's team is the parent's (module docstring)
            sys.modules["torch"].set_num_threads(1)
        signal.signal(signal.SIGINT, signal.SIG_DFL)       # a Ctrl-C is the parent's to handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_WRONLY)     # what the program prints while checked is not its run's
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        payload = ("value", fn(*args))
    except BaseException as exc:        # noqa: BLE001 (everything goes back to the parent)
        payload = ("error", _portable(exc))
    try:
        data = pickle.dumps(payload)
    except Exception as exc:        # an unpicklable value: the parent takes its fallback
        data = pickle.dumps(("error", RunError(f"the check before the run gave an answer that cannot be sent "
                                               f"back: {type(exc).__name__}: {exc}")))
    try:
        with os.fdopen(write, "wb") as pipe:
            pipe.write(data)
    finally:
        os._exit(0)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` as the parent can raise it: xbridge's errors as they are; the user's own exception as the line the
    CLI prints for it (its traceback does not cross the pipe); anything else as its type and first line."""
    if isinstance(exc, XBridgeError):
        return exc if _picklable(exc) else RunError(str(exc))
    from .program_file import failure_line

    located = failure_line(exc)
    if located is not None:
        error = ProgramError(located[0])
        error.exit_code = located[1]
        return error
    if isinstance(exc, KeyboardInterrupt):
        return exc
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return RunError(f"the check before the run failed: {type(exc).__name__}{': ' + message if message else ''} "
                    "(XBRIDGE_DEBUG=1 runs it in this process, with the traceback)")


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
