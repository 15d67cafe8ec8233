"""The call protocol between rank 0 and the other ranks of the distributed Inductor executable.

Rank 0 sends ``(name, args)`` for every executable call before running it itself; a worker runs it on its rank
engine and answers ``("ok", value)`` or ``("error", kind, message)`` (``serve``). Only what rank 0 checks travels
back (a step's loss); rank 0 has every other result itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from xbridge import errors
from xbridge.errors import RunError


def timeout_s() -> float:
    return float(os.environ.get("XBRIDGE_DIST_TIMEOUT", "600"))


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Gloo prints "[Gloo] Rank r is connected to n peer ranks" on file descriptor 1 while groups form; stdout is
    the command's result (``--format json``), so that line goes nowhere."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def rebuild_error(kind: str, message: str, rank: int, call: str) -> Exception:
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.XBridgeError):
        return cls(f"inductor rank {rank}: {message}")
    return RunError(f"inductor rank {rank} failed in {call}: {kind}: {message}")


def answer(name: str, result: Any) -> Any:
    """What a worker sends back: what rank 0 checks (the loss) and what each rank alone has (the part of a
    sharded checkpoint it wrote); rank 0 has every other result itself."""
    if name in ("step", "step_at"):
        return result["loss"]
    return result if name == "write_checkpoint_part" else None


def error_message(exc: BaseException) -> tuple[str, str, str]:
    text = str(exc).strip()
    return ("error", type(exc).__name__, text.splitlines()[0] if text else repr(exc))


def method(engine: Any, name: str) -> Callable[..., Any]:
    """The engine's method ``name``: its own, or that of the collaborator holding it (its diagnostics, probes)."""
    for holder in (engine, *engine.parts):
        if hasattr(holder, name):
            return getattr(holder, name)
    raise AttributeError(f"{type(engine).__name__} has no method {name!r}")


def serve(engine: Any, receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
    """A worker's loop: run each call rank 0 sends on this rank's engine until it says exit. After an error the
    worker reports it and exits, so that whatever collective rank 0 waits in fails at once."""
    while True:
        name, args = receive()
        if name == "exit":
            return
        try:
            result = method(engine, name)(*args)
        except BaseException as exc:
            send(error_message(exc))
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        send(("ok", answer(name, result)))
