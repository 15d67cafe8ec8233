"""Warm starts (xbridge/processes/warm.py): a command forked from a warm server behaves as the same command in a
fresh interpreter (output, exit status, signals, timeouts, descriptors), a command whose environment differs in what
an interpreter fixes at start is not served, and a child does not outlive the client that started it. The whole
suite runs its commands this way (tests/conftest.py); these tests hold the server's own promises, on a server of
their own that imports little (each child imports what it needs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import PROGRAMS, ROOT, user_env
from xbridge.processes import warm

MLP = str(PROGRAMS / "mlp.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    env = {**user_env(), "XBRIDGE_DEBUG": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "xbridge.processes.warm", str(folder), "xbridge.cli.app"],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not warm.socket_path(folder, sys.executable).exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start listening"
        time.sleep(0.05)
    yield {**env, warm.VARIABLE: str(folder)}
    proc.terminate()
    proc.wait(timeout=30)


def _alive(pid):
    try:
        os.kill(pid, 0)         # the server reaps its children as they end
    except ProcessLookupError:
        return False
    return True


def _gone_within(pid, seconds):
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_command_says_and_exits_as_in_a_fresh_interpreter(server, tmp_path):
    cmd = [sys.executable, "-m", "xbridge", "run", str(tmp_path / "nope.py")]
    forked = warm.run(cmd, server, cwd=ROOT)
    fresh = subprocess.run(cmd, capture_output=True, text=True, env={**server, warm.VARIABLE: ""}, cwd=ROOT)
    assert forked is not None and forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and "nope.py' does not exist" in forked.stderr
    ran = warm.run([sys.executable, "-m", "xbridge", "run", MLP, "--steps", "2", "--format", "json"], server,
                   cwd=tmp_path)
    assert ran is not None and ran.returncode == 0, ran.stderr[-2000:]
    assert '"final_loss"' in ran.stdout


def test_what_an_interpreter_fixes_at_start_is_not_served(server):
    cmd = [sys.executable, "-m", "xbridge", "run", MLP]
    assert warm.run(cmd, {**server, "PYTHONHASHSEED": "7"}) is None         # the caller starts a fresh one
    assert warm.run(cmd, {**server, "JAX_ENABLE_X64": "1"}) is None
    assert warm.run([sys.executable, "-c", "print(1)"], server) is None      # not a module: no server runs it
    assert warm.run(cmd, {**server, warm.VARIABLE: ""}) is None             # turned off


def test_a_timeout_kills_the_child_and_raises_as_subprocess_run_does(server):
    started = []
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, "-m", "xbridge", "run", MLP, "--steps", "100000"], server, cwd=ROOT, timeout=3,
                 started=started.append)
    assert started and _gone_within(started[0], 10)


def test_sigterm_ends_it_as_it_ends_xbridge_and_a_gone_client_takes_its_child(server, tmp_path):
    long = [sys.executable, "-m", "xbridge", "run", MLP, "--steps", "100000", "--checkpoint-dir", str(tmp_path / "ck")]
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        proc = warm.start(long, server, out, err, cwd=ROOT)
    assert proc is not None and proc.poll() is None
    time.sleep(4)       # past its start
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, (tmp_path / "err").read_text()[-2000:]
    assert "terminated by SIGTERM" in (tmp_path / "err").read_text()
    with open(os.devnull, "wb") as null:
        orphan = warm.start(long, server, null, null, cwd=ROOT)
    assert orphan is not None
    orphan._conn.close()        # the client goes (as when its process dies): the server ends the child
    assert _gone_within(orphan.pid, 10)


def test_descriptors_passed_keep_their_numbers(server, tmp_path):
    (tmp_path / "writes_to.py").write_text("import os, sys\n"
                                           "os.write(int(sys.argv[1]), b'through ' + sys.argv[1].encode())\n")
    read, write = os.pipe()
    proc = warm.start([sys.executable, "-m", "writes_to", str(write)], server, cwd=tmp_path, pass_fds=(write,))
    os.close(write)
    assert proc is not None and proc.wait(timeout=60) == 0
    assert os.read(read, 100) == f"through {write}".encode()
    os.close(read)
