"""The other ranks, seen from rank 0: child processes it started (``SpawnedPeers``) or torchrun's ranks
(``TorchrunPeers``). A worker that dies or stops answering becomes a one-line RunError naming the rank, how it
ended and its log, never a hang: gloo reports a closed peer at once, and every wait is bounded by
``XBRIDGE_DIST_TIMEOUT`` seconds (default 600)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from xbridge.errors import RunError
from xbridge.plugin import describe_exit, temporary_folder, warm

from .rpc import rebuild_error, serve

WORKER_MODULE = "xbridge.backends.inductor.worker"


def last_error(path: Path) -> str:
    """The last line of a worker's log that names an error (its traceback's last line), if any."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if "Error" in ln]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


@dataclass
class Worker:
    rank: int
    process: subprocess.Popen | warm.Process
    conn: Connection
    log: Path
    log_file: IO[str]

    def failure(self, call: str) -> RunError | None:
        code = self.process.poll()
        if code is None:
            return None
        tail = last_error(self.log)
        return RunError(f"inductor rank {self.rank} {describe_exit(code)} during {call}"
                        + (f" ({tail})" if tail else "") + f"; its log: {self.log}")


class SpawnedPeers:
    """Ranks 1..N-1 as child processes of this one."""

    def __init__(self, setup: dict[str, Any], world: int, timeout: float) -> None:
        self.timeout = timeout
        self.logs = Path(tempfile.mkdtemp(prefix="xbridge-inductor-"))
        self.failed = False   # a failure names a worker's log: keep the logs then
        self.workers = [self._spawn(rank, setup) for rank in range(1, world)]

    def _spawn(self, rank: int, setup: dict[str, Any]) -> Worker:
        parent, child = socket.socketpair()
        log = self.logs / f"rank{rank}.log"
        log_file = open(log, "w")
        env = {**os.environ, "XBRIDGE_INDUCTOR_RANK": str(rank), **temporary_folder(self.logs)}
        cmd = [sys.executable, "-m", WORKER_MODULE, str(child.fileno())]
        process = warm.start(cmd, env, log_file, subprocess.STDOUT, pass_fds=(child.fileno(),)) or subprocess.Popen(
            cmd, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=env)
        child.close()
        conn = Connection(parent.detach())
        conn.send({**setup, "rank": rank})
        return Worker(rank, process, conn, log, log_file)

    def send(self, name: str, args: tuple) -> None:
        for worker in self.workers:
            try:
                worker.conn.send((name, args))
            except OSError:
                self.failed = True
                raise worker.failure(name) or RunError(f"inductor rank {worker.rank} is gone ({name}); its log: "
                                                       f"{worker.log}") from None

    def _reply(self, worker: Worker, call: str) -> Any:
        try:
            return self._receive(worker, call)
        except Exception:
            self.failed = True
            raise

    def _receive(self, worker: Worker, call: str) -> Any:
        deadline = time.monotonic() + self.timeout
        while not worker.conn.poll(0.05):
            failure = worker.failure(call)
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise RunError(f"inductor rank {worker.rank} did not answer {call} within {self.timeout:.0f} s "
                               f"(XBRIDGE_DIST_TIMEOUT); its log: {worker.log}")
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=10)
            raise worker.failure(call) or RunError(f"inductor rank {worker.rank} closed its connection during "
                                                   f"{call}; its log: {worker.log}") from None
        if message[0] == "error":
            raise rebuild_error(message[1], f"{message[2]} (its log: {worker.log})", worker.rank, call)
        return message[1]

    def replies(self, call: str) -> list[Any]:
        return [self._reply(worker, call) for worker in self.workers]

    def failure(self, call: str, wait: float = 5.0) -> Exception | None:
        """After rank 0 failed inside a collective: the worker that caused it (its report, or its death)."""
        deadline = time.monotonic() + wait
        while True:
            for worker in self.workers:
                if worker.conn.poll(0):
                    try:
                        self._reply(worker, call)
                    except Exception as exc:   # its error report, or its end
                        return exc
                failure = worker.failure(call)
                if failure is not None:
                    self.failed = True
                    return failure
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def close(self, kill: bool) -> None:
        for worker in self.workers:
            if kill and worker.process.poll() is None:
                worker.process.kill()
            with contextlib.suppress(OSError):
                worker.conn.send(("exit", ()))
        deadline = time.monotonic() + 10
        for worker in self.workers:
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.log_file.close()
            worker.conn.close()
        if not kill and not self.failed:
            shutil.rmtree(self.logs, ignore_errors=True)


class TorchrunPeers:
    """Ranks 1..N-1 started by torchrun, taking calls over a gloo group (``serve`` on their side)."""

    def __init__(self, group: Any, world: int) -> None:
        self.group, self.world = group, world

    def send(self, name: str, args: tuple) -> None:
        dist.broadcast_object_list([(name, args)], src=0, group=self.group)

    def replies(self, call: str) -> list[Any]:
        everyone: list[Any] = [None] * self.world
        dist.gather_object(("ok", None), everyone, dst=0, group=self.group)
        for rank, message in enumerate(everyone[1:], start=1):
            if message[0] == "error":
                raise rebuild_error(message[1], message[2], rank, call)
        return [message[1] for message in everyone[1:]]

    def failure(self, call: str) -> Exception | None:
        return None   # torchrun's agent stops every rank when one fails, and names it

    def close(self, kill: bool) -> None:
        if not kill:
            self.send("exit", ())


def torchrun_worker(engine: Any, group: Any) -> None:
    """A torchrun rank other than 0: serve rank 0's calls, then leave without writing anything."""
    def receive() -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def send(message: Any) -> None:
        dist.gather_object(message, None, dst=0, group=group)

    send(("ok", None))   # setup
    serve(engine, receive, send)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
