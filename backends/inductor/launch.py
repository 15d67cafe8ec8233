"""The distributed Inductor executable: rank 0 drives, the other ranks mirror each call.

Every call of the executable (init, step, state_dict, ...) is sent to ranks 1..N-1 before rank 0 runs it, so all
ranks enter the same collectives in the same order; each rank answers (its loss, or its error) and rank 0 returns
its own result. Two ways to get the other ranks:

- by itself (``xbridge run --backend inductor-cpu --devices N``): the xbridge process is rank 0 and starts ranks
  1..N-1 (``python -m xbridge.backends.inductor.worker``), each connected to it by a private socket pair and writing
  its output to a log file. A worker that dies or stops answering becomes a one-line RunError naming the rank, how
  it ended and its log, never a hang: gloo reports a closed peer at once, and every wait is bounded by
  ``XBRIDGE_DIST_TIMEOUT`` seconds (default 600);
- under torchrun (``RANK`` and ``WORLD_SIZE`` set): every rank runs ``xbridge run``; rank 0 goes on with the run,
  and the others turn into workers inside ``lower()``, taking their calls over a gloo group, and exit when rank 0
  is done, so only rank 0 writes results.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
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
from typing import IO, Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from xbridge import errors
from xbridge.backend import Target
from xbridge.errors import LoweringError, RunError
from xbridge.planning import ShardingPlan
from xbridge.program import Program

from .distributed import MeshRoles, RankEngine, device_for, process_group_backend

WORKER_MODULE = "xbridge.backends.inductor.worker"


def timeout_s() -> float:
    return float(os.environ.get("XBRIDGE_DIST_TIMEOUT", "600"))


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def program_source(program: Program) -> tuple[str, str]:
    """The program file and attribute this program came from (workers load the same code and apply this
    program's configuration, so CLI overrides carry over)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("xbridge_program_") or not getattr(module, "__file__", None):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Program) and value.model is program.model and value.loss is program.loss:
                return str(module.__file__), attr
    raise LoweringError(f"program {program.name!r} was not loaded from a program file, but inductor on several "
                        "processes loads the program in each worker; run it from a file (xbridge run FILE.py) or "
                        "under torchrun")


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


def describe_exit(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def last_error(path: Path) -> str:
    """The last line of a worker's log that names an error (its traceback's last line), if any."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if "Error" in ln]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def rebuild_error(kind: str, message: str, rank: int, call: str) -> Exception:
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.XBridgeError):
        return cls(f"inductor rank {rank}: {message}")
    return RunError(f"inductor rank {rank} failed in {call}: {kind}: {message}")


def answer(name: str, result: Any) -> Any:
    """What a worker sends back: only what rank 0 checks (the loss); rank 0 has every other result itself."""
    return result["loss"] if name == "step" else None


def error_message(exc: BaseException) -> tuple[str, str, str]:
    text = str(exc).strip()
    return ("error", type(exc).__name__, text.splitlines()[0] if text else repr(exc))


def serve(engine: RankEngine, receive: Callable[[], Any], send: Callable[[Any], None]) -> None:
    """A worker's loop: run each call rank 0 sends on this rank's engine until it says exit. After an error the
    worker reports it and exits, so that whatever collective rank 0 waits in fails at once."""
    while True:
        name, args = receive()
        if name == "exit":
            return
        try:
            result = getattr(engine, name)(*args)
        except BaseException as exc:
            send(error_message(exc))
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        send(("ok", answer(name, result)))


# ---------------------------------------------------------------------- the other ranks, seen from rank 0

@dataclass
class Worker:
    rank: int
    process: subprocess.Popen
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
        env = {**os.environ, "XBRIDGE_INDUCTOR_RANK": str(rank)}
        process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(child.fileno())],
                                   pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, env=env)
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


def torchrun_worker(engine: RankEngine, group: Any) -> None:
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


# ---------------------------------------------------------------------- the executable

_live: list["DistributedExecutable"] = []   # the spawned run of this process that owns the default group

class DistributedExecutable:
    """The Executable protocol over N processes (see the module docstring). Results are rank 0's; every rank
    computes the same loss, and each step checks that they agree."""

    def __init__(self, program: Program, plan: ShardingPlan, target: Target, mode: str) -> None:
        self.program, self.plan, self.target, self.mode = program, plan, target, mode
        MeshRoles(plan)   # an unsupported layout fails here, before any process starts
        self.timeout = timeout_s()
        self._closed = False
        world = plan.devices
        backend = process_group_backend(target.device)
        pg_timeout = datetime.timedelta(seconds=self.timeout)
        self.peers: SpawnedPeers | TorchrunPeers
        if under_torchrun():
            have = int(os.environ["WORLD_SIZE"])
            if have != world:
                raise errors.ConfigError(f"torchrun started {have} processes but --devices is {world}; pass "
                                         f"--devices {have}")
            self.owns_group = not dist.is_initialized()
            with quiet_stdout():
                if self.owns_group:
                    dist.init_process_group(backend, timeout=pg_timeout)
                control = dist.new_group(backend="gloo", timeout=pg_timeout)
            rank = dist.get_rank()
            debug_dir = os.environ.get("TORCH_COMPILE_DEBUG_DIR")
            if debug_dir and rank:
                os.environ["TORCH_COMPILE_DEBUG_DIR"] = os.path.join(debug_dir, f"rank{rank}")
            self.device = device_for(target.device, int(os.environ.get("LOCAL_RANK", rank)))
            with quiet_stdout():
                engine = RankEngine(program, plan, self.device, mode)
            if rank:
                torchrun_worker(engine, control)   # does not return
            self.peers = TorchrunPeers(control, world)
            atexit.register(self.close)
            self.engine = engine
        else:
            self.owns_group = True
            file, attr = program_source(program)
            if _live and _live[-1] is not self:   # one default process group per process: retire the last run's
                _live[-1].close()
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=pg_timeout)
            setup = {"world": world, "port": store.port, "file": file, "attr": attr, "config": program.config(),
                     "config_hash": program.config_hash, "plan": plan, "device": target.device, "mode": mode,
                     "timeout": self.timeout}
            self.peers = SpawnedPeers(setup, world, self.timeout)
            _live.append(self)
            atexit.register(self.close)
            self.peers.replies("start")      # every worker loaded the program and is joining the group
            with quiet_stdout():
                dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=pg_timeout)
            self.device = device_for(target.device, 0)
            with quiet_stdout():
                self.engine = self._run("setup", lambda: RankEngine(program, plan, self.device, mode))
        self.peers.replies("setup")

    def _run(self, call: str, local: Callable[[], Any]) -> Any:
        """Rank 0's part of a call; a failure caused by another rank is reported as that rank's."""
        try:
            return local()
        except errors.XBridgeError:   # rank 0's own verdict on the program (every rank reaches the same)
            self.close(kill=True)
            raise
        except Exception as exc:
            failure = self.peers.failure(call)
            self.close(kill=True)
            if failure is not None:
                raise failure from exc
            raise

    def _call(self, name: str, *args: Any) -> tuple[Any, list[Any]]:
        if self._closed:
            raise RunError(f"the inductor processes were stopped; {name} cannot run")
        self.peers.send(name, args)
        result = self._run(name, lambda: getattr(self.engine, name)(*args))
        try:
            replies = self.peers.replies(name)
        except Exception:
            self.close(kill=True)
            raise
        return result, replies

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks (they exit when told; killed after 10 s, or at once with ``kill``)."""
        if self._closed:
            return
        self._closed = True
        self.peers.close(kill)
        if self in _live:
            _live.remove(self)
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the Executable protocol

    def init(self, weights: dict[str, np.ndarray]) -> None:
        self._call("init", weights)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        metrics, replies = self._call("step", batch)
        for rank, loss in enumerate(replies, start=1):
            if loss != metrics["loss"] and not (math.isnan(loss) and math.isnan(metrics["loss"])):
                raise RunError(f"inductor ranks disagree on the loss: rank 0 has {metrics['loss']!r}, rank {rank} "
                               f"{loss!r}")
        return metrics

    def state_dict(self) -> dict[str, np.ndarray]:
        return self._call("state_dict")[0]

    def training_state(self) -> dict[str, np.ndarray]:
        return self._call("training_state")[0]

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        self._call("load_training_state", state)

    def nonfinite_grads(self) -> list[str]:
        return self._call("nonfinite_grads")[0]

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call("trace_modules", batch)[0]

    def layout(self) -> dict[str, dict[str, Any]]:
        return self._call("layout")[0]

    def recompiles(self) -> int:
        return self._call("recompiles")[0]

    def recompile_reasons(self) -> list[str]:
        return self.engine.recompile_reasons()

    def mark_warm(self) -> None:
        self._call("mark_warm")

    def dump(self, directory: Path) -> list[Path]:
        return self.engine.dump(directory)

    @property
    def device_kind(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def device_peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None
