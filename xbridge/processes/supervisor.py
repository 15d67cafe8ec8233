"""The supervisor: ``--processes P`` starts P processes of the same command on this machine and watches them (exit
statuses, the heartbeat); a process it started dies with it, and one whose collective failed because a peer died
waits to be stopped, so that the one line the user reads names the process that died."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import SIGNAL_EXIT, TermSignal
from .heartbeat import HEARTBEAT, TIMEOUT, timeout_s
from .job import CHILD, COORDINATOR, COUNT, INDEX, this_process
from .restarts import ERROR_FILE, RESTARTS, STEPS, end_line, logged_steps

GRACE_S = 5.0      # after one process fails, how long the others get to end on their own before they are killed


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
    # Gloo's connection lines (torch's on stderr; jaxlib's on stdout, relayed: xbridge/run/framework_noise.py), also
    # when another writer's output cut one in two
    lines = [line for line in lines if not line.startswith("[Gloo]") and "connected peer ranks" not in line]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line:
            return line.removeprefix("error: ")
    return lines[-1] if lines else None


def start(count: int, argv: list[str], max_restarts: int = 0, checkpoint_dir: Path | None = None,
          steps: int | None = None) -> int:
    """Start ``count`` processes of ``xbridge argv`` on this machine (coordinator on 127.0.0.1 when there are
    several) and wait for them.
    Process 0 prints to this terminal; the others' output goes to log files. When one fails, the rest get
    :data:`GRACE_S` seconds to end on their own (a collective waiting for the dead peer may never return) and are
    then killed. When no process makes progress for :func:`timeout_s` seconds, all are stopped and the one that
    stopped first is named. The exit status: 0; process 0's when it failed (it said why on this terminal);
    otherwise the failed process's 2 (bad input) or 1, with one line naming it.

    ``max_restarts``: a job that fails other than on bad input (exit 2) or Ctrl-C is started again (a process that
    SIGTERM stopped, exit 143 after its checkpoint, included: maintenance stopped it, not the program), every process,
    from the newest committed checkpoint in ``checkpoint_dir`` (from where the command started when there is none),
    at most that many times (restarts.py: the steps log and the restarts the last attempt's record holds); not
    when that checkpoint is of the last of ``steps`` (the training is done: the failure is reported). One process
    (``count`` 1) is how a run whose backend starts processes of its own (inductor's ranks) is restarted."""
    try:
        return _start(count, argv, max_restarts, checkpoint_dir, steps)
    except (KeyboardInterrupt, TermSignal) as exc:      # each process said where it stopped (its checkpoint first)
        return SIGNAL_EXIT[signal.SIGTERM if isinstance(exc, TermSignal) else signal.SIGINT]


def _start(count: int, argv: list[str], max_restarts: int, checkpoint_dir: Path | None, steps: int | None) -> int:
    if max_restarts == 0:
        code, said, _ = _attempt(count, argv, {})
        if said:
            print(f"error: {said}", file=sys.stderr)
        return code
    from ..checkpoint import locate
    from ..errors import CheckpointError

    scratch = Path(tempfile.mkdtemp(prefix="xbridge-restarts-"))
    steps_log = scratch / "steps.jsonl"
    done: list[dict] = []
    began, attempt_argv = time.monotonic(), list(argv)
    try:
        while True:
            code, said, own = _attempt(count, attempt_argv, {STEPS: str(steps_log), RESTARTS: json.dumps(done)})
            if code in (0, 2, 130) or len(done) >= max_restarts:
                tried = f" (after {len(done)} restart(s), the most --max-restarts {max_restarts} allows)" \
                    if code not in (0, 2, 130) else ""
                if said:       # (process 0 says its own failure on this terminal, the restarts above it)
                    print(f"error: {said}{tried}", file=sys.stderr)
                return code
            newest = None
            if checkpoint_dir is not None:
                with contextlib.suppress(CheckpointError):
                    newest = locate(checkpoint_dir)
            given = _value(argv, "--resume")        # the command's own --resume, where no checkpoint is newer
            start_at = newest
            if start_at is None and given is not None:
                with contextlib.suppress(CheckpointError):
                    start_at = locate(Path(given))
            from_step = int(start_at.name.rpartition("-")[2]) if start_at is not None else 0
            message = said or own or f"process 0 exited with code {code}"
            if newest is not None and steps is not None and from_step >= steps:
                print(f"error: {message} (after the checkpoint of the last step, {newest}: nothing is left to redo)",
                      file=sys.stderr)
                return code
            finished = [record["step"] for record in logged_steps(str(steps_log))]
            reached = max(finished) + 1 if finished else 0
            # SIGTERM stopped the job at one step (every process agreed on it: which one the signal reached is not
            # known here); otherwise the process the line names
            failed_index, status = (None, "was terminated by SIGTERM") if code == SIGNAL_EXIT[signal.SIGTERM] \
                else _failure(message)
            done.append({"after_s": round(time.monotonic() - began, 1), "process": failed_index, "status": status,
                         "message": message, "from_step": from_step, "steps_redone": max(reached - from_step, 0)})
            where = (f"checkpoint {start_at}" if start_at is not None
                     else "step 0 (no checkpoint yet)")
            what = f"all {count} processes" if count > 1 else "the job"
            print(f"xbridge: {message}; restarting {what} from {where} (restart {len(done)} of {max_restarts})",
                  file=sys.stderr)
            attempt_argv = _resuming(argv, checkpoint_dir) if newest is not None else list(argv)
            end_line(steps_log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# what a restart from a checkpoint replaces: the starting weights, the profiled steps (maybe behind it), a resume
_NOT_ON_RESTART = ("--init-state", "--profile", "--resume")


def _resuming(argv: list[str], checkpoint_dir: Path | None) -> list[str]:
    """The command with ``--resume DIR`` (its newest checkpoint) in place of what conflicts with it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _NOT_ON_RESTART:
            skip = True
            continue
        if arg.startswith(tuple(f"{flag}=" for flag in _NOT_ON_RESTART)):
            continue
        out.append(arg)
    return [*out, "--resume", str(checkpoint_dir)]


def _value(argv: list[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), or None."""
    found = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith(f"{flag}="):
            found = arg.partition("=")[2]
    return found


def _failure(said: str | None) -> tuple[int | None, str | None]:
    """The process the one line names and how it ended (``process 1 of 2 was killed by SIGKILL: ...``; of a run
    with inductor ranks ``inductor rank 1 was killed by SIGKILL during step ...``)."""
    match = re.match(r"process (\d+) of \d+ (was killed by \w+|exited with code -?\d+|made no progress)", said or "") \
        or re.search(r"\brank (\d+) (was killed by \w+|exited with code -?\d+)", said or "")
    return (int(match.group(1)), match.group(2)) if match else (0, None)


def _attempt(count: int, argv: list[str], extra_env: dict[str, str]) -> tuple[int, str | None, str | None]:
    """One start of the job's processes, waited for: the exit status, the line that says which failed (None when
    none did, or process 0 failed and said so itself), and process 0's own error line (None when it said none)."""
    address, limit = f"127.0.0.1:{free_port()}", timeout_s()
    logs = Path(tempfile.mkdtemp(prefix="xbridge-processes-"))
    said_file = logs / "process0.error"
    code, said = _watch(count, argv, extra_env, address, limit, logs, said_file)
    own = said_file.read_text(encoding="utf-8").strip() if said_file.exists() else None
    if not any(line and str(logs) in line for line in (said, own)):    # a log an error line names is kept
        shutil.rmtree(logs, ignore_errors=True)
    return code, said, own or None


def _watch(count: int, argv: list[str], extra_env: dict[str, str], address: str, limit: float, logs: Path,
           said_file: Path) -> tuple[int, str | None]:
    """Start the processes and wait for them (see :func:`_attempt`); process 0 writes its error line to
    ``said_file``."""
    beats = [logs / f"process{index}.beat" for index in range(count)]
    from . import warm  # here, not at the top: the package's import would load it before `python -m` runs it

    procs: list[subprocess.Popen | warm.Process] = []
    try:
        started = time.time()
        temporary = temporary_folder(logs)
        for index in range(count):
            joining = {COORDINATOR: address, COUNT: str(count), INDEX: str(index)} if count > 1 else {}
            env = dict(os.environ, **joining, **{CHILD: "1", HEARTBEAT: str(beats[index])}, **extra_env, **temporary)
            if index == 0:
                env[ERROR_FILE] = str(said_file)
            else:
                env.pop(ERROR_FILE, None)
            with contextlib.ExitStack() as files:
                # process 0 prints to this command's stdout (sys.stdout: native output is kept off the real one,
                # xbridge/run/framework_noise.py)
                sys.stdout.flush()
                out = sys.stdout if index == 0 else files.enter_context(open(logs / f"process{index}.out", "wb"))
                err = None if index == 0 else files.enter_context(open(logs / f"process{index}.log", "wb"))
                # each in its own process group: a Ctrl-C at the terminal reaches this supervisor alone, which
                # passes exactly one SIGINT to each (a second one would abort the final checkpoint)
                # (a warm server's fork where one is set up, xbridge/processes/warm.py: it goes when this process does)
                cmd = [sys.executable, "-m", "xbridge", *argv]
                procs.append(warm.start(cmd, env, out, err) or subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=err, process_group=0, preexec_fn=die_with_parent))
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
                    where = f"its log: {logs / f'process{stuck}.log'}" if stuck else "its output is above"
                    return 1, (f"process {stuck} of {count} made no progress for {limit:g} s ({TIMEOUT}; it was "
                               f"{doing}), and no process has since; every process was stopped ({where})")
            time.sleep(0.2)
        failed += [i for i, p in enumerate(procs) if p.returncode != 0 and i not in failed]
        if not failed:
            return 0, None
        if 0 in failed and procs[0].returncode > 0:
            return procs[0].returncode, None      # process 0 has said what went wrong on this terminal
        index = failed[0]
        code = procs[index].returncode
        said = last_error(logs / f"process{index}.log") if index else None
        where = f"its log: {logs / f'process{index}.log'}" if index else "its output is above"
        return (2 if code == 2 else 1), (f"process {index} of {count} {describe_exit(code)}"
                                         f"{': ' + said if said else ''} ({where})")
    except (KeyboardInterrupt, TermSignal) as exc:      # Ctrl-C, or SIGTERM: passed on to every process
        sig = signal.SIGTERM if isinstance(exc, TermSignal) else signal.SIGINT
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        until = time.monotonic() + limit     # each finishes its step and the checkpoint; one that waits longer
        for p in procs:                      # on a peer than the progress timeout is killed (finally)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, until - time.monotonic()))
        raise                                # the job was stopped here: no restart (start() returns 130 or 143)
    finally:
        _kill(procs)


def temporary_folder(logs: Path) -> dict[str, str]:
    """The environment that gives a started process ``logs/tmp`` as its temporary folder (``TMPDIR``): what it and
    the frameworks put there (a follower's scratch files, torch's own temporary modules) goes with the logs folder
    when the job ends well, and stays beside the logs its error line names otherwise, where a process killed
    before it could clean up would have left it in the system's temporary folder."""
    folder = logs / "tmp"
    folder.mkdir(mode=0o700, exist_ok=True)
    return {"TMPDIR": str(folder)}


def die_with_parent() -> None:
    """Called in a started process (the supervisor's children before they run, inductor's worker ranks): on Linux
    the kernel kills it when its parent dies, however it dies (SIGKILL leaves the parent no time to stop it), so no
    process of a job outlives the command that started it. Elsewhere nothing: the parent's own exits stop them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):       # no prctl in this libc (not Linux)
        pass


def _kill(procs: list[Any]) -> None:      # subprocess.Popen or warm.Process
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
