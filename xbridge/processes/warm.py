"""Warm starts: ``python -m MODULE ARGS`` (``xbridge``, inductor's rank worker) as a fork of an interpreter that has
imported the frameworks already.

A fresh interpreter pays its imports before any work: torch 1.8 s, JAX 0.5 s more, a Hugging Face model's modules
3-5 s, torch_xla 5.6 s (measured on the 2-core machine of docs/testing.md), and for a small program that is most of
a run. A *warm server* (``python -m xbridge.processes.warm FOLDER [MODULE...]``) imports the modules named (or
:data:`PRELOAD`), listens on a Unix socket in FOLDER named for its interpreter, and answers each request by forking:
the child takes the request's environment, folder, arguments and file descriptors (its stdout and stderr, and any
other it is to keep: passed over the socket) and runs the module as ``python -m`` would; the server reports its
process id, then its exit status (negative: the signal that ended it), and kills it if the client goes first (as
``PR_SET_PDEATHSIG`` would: no process outlives the command that started it). A 6-step ``xbridge run`` of an HF
ResNet: 1.08 s warm against 5.57 s fresh on eager-cpu, 3.58 against 9.00 on inductor-cpu, 2.03 against 6.79 on
jax-cpu, 4.45 against 9.76 on xla-cpu (bench/warm_start.py).

What a fork shares with a fresh interpreter and what it does not:
- nothing of a compiler's runtime is started in the server: it imports and never computes (no JAX backend, no
  OpenMP team: GNU OpenMP cannot run in a child of a process that used it, xbridge/forked.py), so each child sets
  its own device counts and flags as a fresh process does;
- torchax is not imported there: importing it changes ``torch.accelerator`` for the process, and Dynamo then fails
  (the jax backend corrects that when it loads torchax, xbridge/backends/jaxjit/patches.py);
- what an interpreter reads once at start or import (``PYTHON*`` and ``LD_*`` variables, the ``TORCH*``, ``JAX_``
  and ``HF_`` variables of the modules imported) is the server's: a request whose value
  of one of them differs from the server's is not served (:func:`run` returns None, and the caller starts a fresh
  interpreter); what the imports set in the server's environment (torch's default cache folder, libtpu's path) is
  set in the child's where the request does not set it, as a fresh interpreter's imports would;
- at its end the child runs the exit handlers and waits for its threads, as an interpreter does before it exits.

Who uses it: :func:`run` and :func:`start` are how parity's and compare's targets start (xbridge/run/isolated.py),
the processes of ``--processes N`` (xbridge/processes/supervisor.py), inductor's ranks (backends/inductor/peers.py),
a command forwarded to or checked in another environment (xbridge/environments.py, xbridge/check/elsewhere.py) and
compare's TPU estimates, and how the test suite starts ``xbridge`` (tests/helpers.py), wherever
``XBRIDGE_WARM_START`` names a folder where a server for the interpreter listens; with none (the default) each
starts a fresh interpreter. The figures a run reports are measured inside it (compile and step times; memory: a
fork's peak resident set counts the pages it shares with the server, as a fresh process counts the same modules),
so compare's table does not change with it. The test suite starts one server per environment for its session
(tests/conftest.py)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["VARIABLE", "Process", "capture", "run", "serve", "socket_path", "start"]

VARIABLE = "XBRIDGE_WARM_START"
# what a server imports when told nothing else: what xbridge's commands import anyway, and the Hugging Face modules
# the programs users bring import. Not torchax (the module docstring), not torch_xla (it reads its settings once, when
# it loads, and each xla run sets them first: xbridge/run/prepare.py). A module not installed is left out.
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx", "jax",
           "optax", "transformers.modeling_utils", "xbridge.cli.app", "xbridge.run.loop", "xbridge.parity.job")
# what an interpreter, or a framework the server imported, reads once, at start or import: a request must agree with
# the server on these. Except: Inductor reads TORCHINDUCTOR_CACHE_DIR at each cache access, and xbridge's inductor
# backend sets TORCHINDUCTOR_VEC_ISA_OK's setting on the config module itself (backends/inductor, configure), a job's
# coordinates are read when its process joins; XLA_FLAGS,
# TPU_*, CUDA_*, OMP_* are read when a runtime starts, in the child.
_FIXED_AT_START = ("PYTHON", "LD_", "MALLOC_", "TORCH", "JAX_", "HF_", "TRANSFORMERS_")
_READ_LATER = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_VEC_ISA_OK",
                         # a job's place, read when the process joins it (xbridge/processes/job.py), not by JAX's import
                         "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"})


def socket_path(folder: str | Path, python: str) -> Path:
    """Where a server for interpreter ``python`` listens in ``folder`` (the name as given, not resolved: two virtual
    environments of one Python are two interpreters)."""
    digest = hashlib.sha1(os.path.abspath(python).encode()).hexdigest()[:16]
    return Path(folder) / f"{digest}.sock"


def _differs(request: dict[str, str], started: dict[str, str], added: dict[str, str]) -> list[str]:
    """The variables fixed at start whose value in ``request`` is not the server's: neither what it started with
    nor what its imports set (a client that imported torch has torch's own defaults in its environment too)."""
    keys = {key for key in (*request, *started) if key.startswith(_FIXED_AT_START) and key not in _READ_LATER}
    return sorted(key for key in keys
                  if request.get(key) != started.get(key) and not (key in added and request.get(key) == added[key]))


class _Lines:
    """The server's messages on a connection, a JSON object a line."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def next(self, timeout: float | None) -> dict | None:
        """The next message; None when none came in ``timeout`` seconds, {} when the server closed the connection."""
        while b"\n" not in self.buffer:
            if not select.select([self.conn], [], [], timeout)[0]:
                return None
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return {}
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


class Process:
    """A child a server started: as much of ``subprocess.Popen`` as a supervisor needs (poll, wait, signals)."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, reader: _Lines) -> None:
        self.args, self.pid = args, pid
        self.returncode: Any = None      # typed as Popen's: None until it ended, then the exit status
        self._conn, self._reader = conn, reader

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._ended(self._reader.next(0))

    def wait(self, timeout: float | None = None) -> int:
        code = self.returncode if self.returncode is not None else self._ended(self._reader.next(timeout))
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            _kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _ended(self, message: dict | None) -> int | None:
        if message is None:
            return None
        self.returncode = int(message.get("returncode", -signal.SIGKILL))    # {}: the server went before its child
        self._conn.close()
        return self.returncode


def start(cmd: list[str], env: dict[str, str], stdout: Any = None, stderr: Any = None,
          cwd: str | Path | None = None, pass_fds: tuple[int, ...] = ()) -> Process | None:
    """``cmd`` (``[PYTHON, "-m", MODULE, ARGS...]``) forked from a warm server of PYTHON, its output going to
    ``stdout`` and ``stderr`` (files or descriptors; None: this process's own; ``subprocess.STDOUT``: with stdout)
    and the descriptors ``pass_fds`` open in it under the same numbers, as ``subprocess.Popen`` would start it;
    None where no server serves it (none running, not a ``-m`` command, an environment that differs in what is
    fixed at start). The child is killed when this process closes the connection or ends, however it ends."""
    folder = env[VARIABLE] if VARIABLE in env else os.environ.get(VARIABLE)     # set empty: off
    if not folder or len(cmd) < 3 or cmd[1] != "-m":
        return None
    path = socket_path(folder, cmd[0])
    if not path.exists():
        return None
    out = _descriptor(stdout, 1)
    err = out if stderr is subprocess.STDOUT else _descriptor(stderr, 2)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        request = {"module": cmd[2], "argv": cmd[3:], "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                   "fds": list(pass_fds)}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out, err, *pass_fds])
        reader = _Lines(conn)
        first = reader.next(None)
    except OSError:     # a server that has gone: a fresh interpreter instead
        conn.close()
        return None
    if not first or "pid" not in first:     # refused (what is fixed at start differs) or gone
        conn.close()
        return None
    return Process(cmd, first["pid"], conn, reader)


def _descriptor(stream: Any, default: int) -> int:
    if stream is None:
        return default
    if isinstance(stream, int):
        return stream
    stream.flush()
    return int(stream.fileno())


def capture(cmd: list[str], env: dict[str, str], cwd: str | Path | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``: a warm server's fork where one serves it
    (:func:`run`), a fresh interpreter elsewhere."""
    return run(cmd, env, cwd, timeout) or subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                                                         timeout=timeout)


def run(cmd: list[str], env: dict[str, str], cwd: str | Path | None = None, timeout: float | None = None,
        started: Callable[[int], None] | None = None) -> subprocess.CompletedProcess | None:
    """:func:`start`, waiting, as ``subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`` would run it (``subprocess.TimeoutExpired`` raised after the child is killed); None where no
    server serves it. ``started`` is called with the child's process id once it runs (to pass signals on)."""
    with tempfile.TemporaryDirectory(prefix="xbridge-warm-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = start(cmd, env, out, err, cwd)
        if proc is None:
            return None
        timed_out = False
        try:
            if started is not None:
                started(proc.pid)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
        except BaseException:       # interrupted here: the child goes too, as subprocess.run's would
            proc.kill()
            raise
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout or 0.0, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode or 0, stdout, stderr)


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(folder: Path, modules: list[str]) -> None:
    """The server: import ``modules`` (one that does not import is left out), listen, fork a child per request, and
    end when the process that started it has ended or its socket file is removed."""
    import importlib

    parent = os.getppid()
    started_env = dict(os.environ)      # before the imports, which may set variables of their own
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:       # noqa: BLE001 (an optional module: a child imports what it needs itself)
            pass
    added = {key: value for key, value in os.environ.items() if started_env.get(key) != value}
    path = socket_path(folder, sys.executable)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path) + ".new")
    os.replace(str(path) + ".new", path)      # the name appears once the server listens
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}    # child pid -> the connection its exit status goes to
    try:
        while os.getppid() == parent and path.exists():
            watched = [conn for conn in waiting.values() if conn.fileno() >= 0]
            for ready in select.select([listener, *watched], [], [], 0.05)[0]:
                if ready is listener:
                    conn = listener.accept()[0]
                    pid = _answer(conn, listener, started_env, added, waiting)
                    if pid is not None:
                        waiting[pid] = conn
                else:       # the client went (it sends nothing after its request): its child goes too
                    _client_gone(ready, waiting)
            _reap(waiting)
    finally:
        for pid in waiting:
            _kill(pid)
        listener.close()
        if path.exists():
            path.unlink()


def _client_gone(conn: socket.socket, waiting: dict[int, socket.socket]) -> None:
    try:
        gone = not conn.recv(1 << 12)
    except OSError:
        gone = True
    if gone:
        for pid, held in waiting.items():
            if held is conn:
                _kill(pid)
        conn.close()


def _answer(conn: socket.socket, listener: socket.socket, started_env: dict[str, str], added: dict[str, str],
            waiting: dict[int, socket.socket]) -> int | None:
    conn.settimeout(10)
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 16)
        while data and not data.endswith(b"\n"):
            more = conn.recv(1 << 16)
            if not more:
                break
            data += more
        request = json.loads(data or b"{}")
    except (OSError, ValueError):
        request = {}
    conn.settimeout(None)
    complete = request and len(fds) == 2 + len(request.get("fds", []))
    differs = _differs(request["env"], started_env, added) if complete else ["no request"]
    if differs:
        reason = f"differs in what an interpreter fixes at start: {', '.join(differs)}"
        print(f"refused {request.get('module')} {' '.join(request.get('argv', [])[:2])}: {reason}", file=sys.stderr,
              flush=True)
        _send(conn, {"refused": reason})
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in waiting.values():
            other.close()
        conn.close()
        _child(request, added, fds)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    return pid


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None and conn.fileno() >= 0:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(conn, {"returncode": code})
            conn.close()


def _child(request: dict, added: dict[str, str], fds: list[int]) -> None:
    """Become ``python -m MODULE ARGV`` in the request's environment and folder, with its output and descriptors;
    never returns."""
    import runpy

    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)        # as a fresh process of its own: a signal to the server's group does not reach it
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]      # clear of every number asked for
        for fd in fds:
            os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, number in zip(high, [1, 2, *request["fds"]], strict=True):
            os.dup2(fd, number)     # inheritable, as Popen's pass_fds leaves them
        for fd in high:
            os.close(fd)
        os.environ.clear()
        os.environ.update({**added, **request["env"]})     # as the imports would have set them
        tempfile.tempdir = None     # the server's imports asked for it once: found again from this TMPDIR
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]       # as `python -m` puts the current folder first
        sys.argv = [sys.argv[0], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:       # noqa: BLE001 (as the interpreter does: the traceback, exit 1)
            import traceback

            traceback.print_exc()
            code = 1
        _end_as_an_interpreter_does()
    finally:
        os._exit(code)


def _end_as_an_interpreter_does() -> None:
    import atexit
    import threading

    try:
        threading._shutdown()       # type: ignore[attr-defined]  # the non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


if __name__ == "__main__":
    serve(Path(sys.argv[1]), sys.argv[2:] or list(PRELOAD))
