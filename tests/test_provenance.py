"""The run record says where it came from: the command line, the program file, and the git commit of the program's
folder with a dirty flag (uncommitted changes under that folder)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from helpers import PROGRAMS, run_cli
from xbridge.run.provenance import git_state

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_a_program_in_a_repository_records_its_commit_and_dirty_flag(tmp_path):
    repo = tmp_path / "repo"
    (repo / "progs").mkdir(parents=True)
    program = repo / "progs" / "mlp.py"
    program.write_text((PROGRAMS / "mlp.py").read_text())
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "mlp")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_state(repo / "progs") == {"commit": head, "dirty": False, "root": str(repo.resolve())}
    program.write_text(program.read_text() + "\n# tuned\n")
    assert git_state(repo / "progs")["dirty"] is True
    proc = run_cli("run", str(program), "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)["provenance"]
    assert record["command"] == ["xbridge", "run", str(program), "--steps", "2", "--format", "json"]
    assert record["program_file"] == str(program.resolve())
    assert record["git"] == {"commit": head, "dirty": True, "root": str(repo.resolve())}


def test_a_program_outside_a_repository_has_no_commit(tmp_path):
    assert git_state(tmp_path) is None
