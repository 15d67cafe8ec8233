"""Warm starts (issue #20): a second process running the same program loads what the first compiled, as each
backend's own counters say (Inductor's FX-graph and AOTAutograd cache hits, JAX's persistent-cache events), and
the cache does not grow; `xbridge cache` lists and clears the caches. xla-cpu has no persistent cache (PJRT CPU
cannot reload executables) and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PROGRAMS, ROOT, one_error_line, user_env

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def _env(cache: Path, seed: str) -> dict[str, str]:
    """A user's shell: xbridge's cache folder, no cache variables of the frameworks' own, another hash seed (a
    per-process random name in a cache key would then miss)."""
    env = {k: v for k, v in user_env().items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "XBRIDGE_DEBUG")}
    return env | {"XBRIDGE_CACHE_DIR": str(cache), "PYTHONHASHSEED": seed}


def _xbridge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xbridge", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


def _run(program: str, target: str, cache: Path, seed: str) -> dict:
    proc = _xbridge("run", str(PROGRAMS / program), "--backend", target, "--steps", "2", "--format", "json",
                    env=_env(cache, seed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["compile_cache"]


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("program,target,cache_name", [("mlp.py", "inductor-cpu", "inductor"),
                                                       ("mlp.py", "jax-cpu", "jax")])
def test_second_process_compiles_nothing_new(tmp_path, program, target, cache_name):
    cold = _run(program, target, tmp_path, "1")
    assert cold["state"] == "cold" and cold["misses"] > 0, cold
    written = _files(tmp_path / cache_name)
    warm = _run(program, target, tmp_path, "2")
    assert warm["state"] == "warm" and warm["misses"] == 0 and warm["hits"] >= cold["misses"], (cold, warm)
    if cache_name == "jax":
        assert warm["hits"] == cold["misses"]          # every executable the first run compiled is reused
    after = _files(tmp_path / cache_name)
    assert set(after) - set(written) <= {p for p in after if "/locks/" in p or p.endswith(".lock")}, \
        sorted(set(after) - set(written))[:5]          # nothing new was compiled into the cache


def test_xla_cpu_says_it_has_no_persistent_cache(tmp_path):
    first = _run("mlp.py", "xla-cpu", tmp_path, "1")
    second = _run("mlp.py", "xla-cpu", tmp_path, "2")
    assert first["state"] == second["state"] == "cold" and second["misses"] == first["misses"] > 0
    assert "cannot reload" in second["caches"] and second["seconds"]["XLA compile"] > 0
    # the optimizer's state exists before step 0 (xbridge/torch/optimizer_state.py): both steps ran one graph
    assert first["compiles"]["train step"] == second["compiles"]["train step"] == 1, first


def test_cache_command_lists_and_clears(tmp_path):
    _run("mlp.py", "jax-cpu", tmp_path, "1")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not a cache")
    (tmp_path / "jax" / "my-notes.txt").write_text("mine, in the cache folder")
    env = _env(tmp_path, "1")
    listed = json.loads(_xbridge("cache", "--format", "json", env=env).stdout)
    rows = {row["name"]: row for row in listed["caches"]}
    assert listed["root"] == str(tmp_path) and set(rows) == {"jax"} and rows["jax"]["files"] > 0
    assert rows["jax"]["not_a_cache"] == ["my-notes.txt"]
    bad = _xbridge("cache", "--clear", "notes", env=env)
    assert bad.returncode == 2 and "cache 'notes' is not an xbridge cache" in one_error_line(bad)
    cleared = _xbridge("cache", "--clear", "--format", "json", env=env)
    assert cleared.returncode == 0 and [r["name"] for r in json.loads(cleared.stdout)["caches"]] == ["jax"]
    assert (tmp_path / "notes" / "mine.txt").read_text() == "not a cache"
    assert [p.name for p in (tmp_path / "jax").iterdir()] == ["my-notes.txt"]    # the user's file is left
    after = json.loads(_xbridge("cache", "--format", "json", env=env).stdout)["caches"]
    assert [(r["name"], r["files"], r["not_a_cache"]) for r in after] == [("jax", 0, ["my-notes.txt"])]


def test_cache_folders_are_the_users_alone(tmp_path, monkeypatch):
    """0700: the compilers load code and executables from there."""
    from xbridge.cache import cache_dir

    root = tmp_path / "fresh" / "xbridge"
    monkeypatch.setenv("XBRIDGE_CACHE_DIR", str(root))
    path = cache_dir("jax")
    assert path == root / "jax"
    assert (root.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o700)


def test_a_cache_folder_that_cannot_be_one_is_one_line(tmp_path):
    """XBRIDGE_CACHE_DIR naming a file, and a folder other users may write into (the compilers load code from it):
    refused before anything runs, naming the variable."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    proc = _xbridge("run", str(PROGRAMS / "mlp.py"), "--backend", "jax-cpu", "--steps", "1",
                    env={**_env(tmp_path, "1"), "XBRIDGE_CACHE_DIR": str(afile)})
    assert proc.returncode == 2 and f"XBRIDGE_CACHE_DIR {str(afile)!r} is a file, not a folder" \
        in one_error_line(proc)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    proc = _xbridge("run", str(PROGRAMS / "mlp.py"), "--backend", "jax-cpu", "--steps", "1",
                    env={**_env(tmp_path, "1"), "XBRIDGE_CACHE_DIR": str(shared)})
    assert proc.returncode == 2 and "can be written by other users (mode 777)" in one_error_line(proc)
    assert afile.read_text() == "mine" and list(shared.iterdir()) == []
