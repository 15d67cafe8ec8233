"""Framework environments: other Python interpreters with xbridge installed, where targets run that this one cannot
run (torch_xla 2.9 needs torch 2.9 and Python 3.11), or where the same target runs on other framework versions.

An environment is a name and an interpreter. They are listed in ``<sys.prefix>/xbridge-environments.json`` (or
``XBRIDGE_ENVIRONMENTS_FILE``; written by ``xbridge environments add NAME PYTHON``; make setup adds ``xla`` and
``today``) and in ``XBRIDGE_ENVIRONMENTS`` (``NAME=PYTHON,...``, which wins over the file). A target entry may name
one: ``inductor-cpu@today`` runs inductor-cpu in the environment ``today``; a target without one runs here when it
can, else in the first environment (in the listed order) that can. What an environment can run is asked of it once
(``xbridge backends`` there) and kept on disk beside the compile caches, keyed on the interpreter and the
modification times of its site-packages folders (docs/environments.md).

This module imports no ML framework.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contract import registry
from .contract.backend import Backend, Target
from .errors import BackendUnavailable, ConfigError, RunError
from .processes import warm

VARIABLE = "XBRIDGE_ENVIRONMENTS"
HERE = "here"                   # the interpreter running this xbridge (a reserved name)
FRAMEWORKS = ("torch", "torch_xla", "jax", "torchax")     # the versions that tell environments apart
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")
PROBE_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Environment:
    name: str
    python: str        # the interpreter, as given (absolute once added through `xbridge environments add`)


FILE_VARIABLE = "XBRIDGE_ENVIRONMENTS_FILE"


# what a process started in an environment is given: it knows no environments of its own (it runs what it has)
ALONE = {VARIABLE: "", FILE_VARIABLE: os.devnull}


def config_file() -> Path:
    """``$XBRIDGE_ENVIRONMENTS_FILE``, else ``<sys.prefix>/xbridge-environments.json`` (this environment's own)."""
    return Path(os.environ.get(FILE_VARIABLE) or Path(sys.prefix) / "xbridge-environments.json")


def _from_file() -> dict[str, str]:
    path = config_file()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        listed = data["environments"]
        if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{path}: not an xbridge environments file ({{\"environments\": {{NAME: PYTHON}}}}); fix "
                          "or remove it (`xbridge environments add` writes a new one)") from None
    return dict(listed)


def _from_variable() -> dict[str, str]:
    text = os.environ.get(VARIABLE, "").strip()
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, python = part.partition("=")
        if not sep or not name.strip() or not python.strip():
            raise ConfigError(f"{VARIABLE}: {part!r} is not NAME=PYTHON (e.g. {VARIABLE}=xla=/opt/xla/bin/python)")
        out[_checked_name(name.strip(), VARIABLE)] = python.strip()
    return out


def _checked_name(name: str, where: str) -> str:
    if name == HERE or not _NAME.match(name):
        raise ConfigError(f"{where}: environment name {name!r}: use lowercase letters, digits, '.', '_' or '-' (up to "
                          f"32), not {HERE!r} (the interpreter running xbridge)")
    return name


def configured() -> dict[str, Environment]:
    """Every environment, by name, in the order they are tried: the file's, then the variable's (which wins)."""
    listed = {**_from_file(), **_from_variable()}
    return {name: Environment(name, python) for name, python in listed.items()}


def named(name: str) -> Environment:
    envs = configured()
    if name not in envs:
        known = ", ".join(envs) or "none"
        raise ConfigError(f"environment {name!r} is not known (known: {known}); add it with `xbridge environments add "
                          f"{name} /path/to/python` or {VARIABLE}={name}=/path/to/python")
    return envs[name]


def split_env(text: str) -> tuple[str, str | None]:
    """``TARGET@ENV`` -> (TARGET, ENV); a target without ``@`` -> (TARGET, None). ``here`` is this interpreter."""
    target, sep, env = text.partition("@")
    if not sep:
        return target, None
    env = env.strip().lower()
    if not env:
        raise ConfigError(f"target {text!r}: nothing after '@'; give an environment's name (xbridge environments "
                          "lists them), e.g. inductor-cpu@xla")
    return target, (None if env == HERE else env)


def _fingerprint(python: str) -> str:
    """What changes when packages are installed into or removed from ``python``'s environment."""
    resolved = Path(python).resolve()
    root = resolved.parent.parent
    stamps = [str(resolved)]
    for site in sorted(root.glob("lib/python3*/site-packages")) + [Path(python).parent.parent]:
        with contextlib.suppress(OSError):
            stamps.append(f"{site}:{site.stat().st_mtime_ns}")
    return hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16]


def _cache_path(python: str) -> Path:
    from .cache import cache_root

    return cache_root() / "environments" / f"{_fingerprint(python)}.json"


@functools.cache
def probe(env: Environment) -> dict[str, Any]:
    """What ``env`` has: ``{"python": version, "targets": [rows of `xbridge backends` there]}``. An interpreter
    that does not start or has no xbridge is an environment failure (RunError, exit 1) naming it."""
    path = Path(env.python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RunError(f"environment {env.name!r}: its interpreter {env.python} does not exist or is not executable "
                       f"(xbridge environments remove {env.name}, or add it again)")
    cached = _cache_path(env.python)
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(cached.read_text(encoding="utf-8")))
    code = ("import json, platform; from xbridge.contract import registry as r; "
            "installed = [n for n in r.backend_names() if r.load(n).backend "
            "and not r.load(n).backend.missing_package()]; "
            "print(json.dumps({'python': platform.python_version(), 'installed': installed, "
            "'targets': r.describe()}))")
    try:
        # -P: no source tree from the working directory on its path (the interpreter's own xbridge answers)
        proc = subprocess.run([env.python, "-P", "-c", code], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env={**os.environ, **ALONE, "XBRIDGE_DEBUG": "0"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunError(f"environment {env.name!r} ({env.python}) did not answer what it can run: {exc}") from None
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        raise RunError(f"environment {env.name!r} ({env.python}) has no working xbridge (exit code {proc.returncode}"
                       f": {last}); install it there (pip install -e /path/to/xbridge)")
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RunError(f"environment {env.name!r} ({env.python}) answered no list of targets: {last}") from None
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found), encoding="utf-8")
        tmp.replace(cached)
    return dict(found)


def _available_in(env: Environment, target_text: str, backend: Backend) -> tuple[str | None, str]:
    """The canonical target ``target_text`` names, if ``env`` can run it, and else why not."""
    rows = {row["target"]: row for row in probe(env)["targets"]}
    parsed = registry.parse_target(target_text)
    wanted = [f"{backend.name}-{d}" for d in backend.devices] if isinstance(parsed, str) else [str(parsed)]
    for name in wanted:
        row = rows.get(name)
        if row is not None and row.get("available"):
            return name, ""
    reasons = [f"{rows[n]['reason']}" for n in wanted if n in rows and rows[n].get("reason")]
    return None, reasons[0] if reasons else f"xbridge there has no target {target_text}"


@dataclass(frozen=True)
class Located:
    """A target, its backend (the plugin class, loaded here to validate options) and where it runs (None: here)."""

    target: Target
    backend: Backend
    env: Environment | None

    @property
    def label(self) -> str:
        return str(self.target) if self.env is None else f"{self.target}@{self.env.name}"

    @property
    def python(self) -> str:
        return sys.executable if self.env is None else self.env.python


def locate(text: str) -> Located:
    """Where ``TARGET[@ENV]`` runs: here when it can, else the first environment that can run it; else
    BackendUnavailable saying why not (here; or, where this interpreter lacks the backend's packages and an
    environment has them, there)."""
    target_text, env_name = split_env(text)
    if env_name is None and "@" not in text:
        try:
            target, backend = registry.resolve(target_text)
            return Located(target, backend, None)
        except BackendUnavailable as here:
            backend = registry.declared(target_text)
            reason = str(here)
            for env in configured().values():
                found, why = _available_in(env, target_text, backend)
                if found is not None:
                    return Located(registry.parse_declared(found), backend, env)
                if backend.missing_package() and backend.name in probe(env).get("installed", ()):
                    reason = f"target {target_text} is unavailable: {why} (environment {env.name!r})"
            raise BackendUnavailable(reason) from None
    if env_name is None:        # TARGET@here
        target, backend = registry.resolve(target_text)
        return Located(target, backend, None)
    env = named(env_name)
    backend = registry.declared(target_text)
    found, why = _available_in(env, target_text, backend)
    if found is None:
        raise BackendUnavailable(f"target {target_text} is unavailable in environment {env.name!r} ({env.python}): "
                                 f"{why}")
    return Located(registry.parse_declared(found), backend, env)


def for_packages(text: str) -> tuple[Environment | None, str]:
    """Where a command for ``TARGET[@ENV]`` runs when it needs the backend's packages rather than a device (run and
    compile pass the whole command, check asks for verdicts): the environment named, else the first that has the
    packages this interpreter lacks (None: here); and the target's name there."""
    target_text, env_name = split_env(text)
    if env_name is not None:
        return named(env_name), target_text
    if "@" in text:             # TARGET@here
        return None, target_text
    parsed = registry.parse_target(target_text)
    return installed_in(parsed if isinstance(parsed, str) else parsed.backend), target_text


def stack_text(versions: dict[str, str] | None) -> str:
    """The framework versions a process ran on, short (torch 2.14.1, jax 0.12.0.1), local build labels left out."""
    found = versions or {}
    return ", ".join(f"{k} {found[k].split('+', 1)[0]}" for k in FRAMEWORKS if k in found)


def installed_in(backend_name: str) -> Environment | None:
    """Where ``backend_name``'s packages are installed: None for here (also when nowhere: the caller's own error
    names what is missing), else the first environment that has them (compile and check need the packages, not a
    device: xla-tpu is compiled for on a CPU)."""
    backend = registry.load(backend_name).backend
    if backend is None or not backend.missing_package():
        return None
    for env in configured().values():
        if backend_name in probe(env).get("installed", ()):
            return env
    return None


def available_targets() -> list[str]:
    """Every target that can run here, then each one only an environment can run (given bare: :func:`locate` finds
    it there). A target that runs here is not repeated for an environment; name it as TARGET@ENV to race both."""
    here = [row["target"] for row in registry.describe() if row["available"]]
    out = list(here)
    for env in configured().values():
        out += [row["target"] for row in probe(env)["targets"] if row["available"] and row["target"] not in out]
    return out


def describe_all() -> list[dict[str, Any]]:
    """``xbridge backends``: one row per target, from where it runs (``environment``: ``here`` or a name; a target
    that runs nowhere keeps this interpreter's reason), then a ``TARGET@ENV`` row for each target an environment runs
    that runs here too (what races the same target on two framework versions)."""
    here = registry.describe()
    envs = configured()
    found = {env.name: _rows_or_failure(env) for env in envs.values()}
    rows = []
    for row in here:
        there = None
        if not row["available"]:        # where it runs, else where its packages are (its reason from there)
            missing = _missing_here(row["target"])
            candidates = [(name, r) for name, rs in found.items() for r in rs if r["target"] == row["target"]]
            there = next((c for c in candidates if c[1]["available"]), None) or next(
                (c for c in candidates if missing and _backend_of(c[1]["target"]) in probe(envs[c[0]]).get(
                    "installed", ())), None)
        rows.append({**there[1], "environment": there[0]} if there else {**row, "environment": HERE})
    runs_here = {row["target"] for row in here if row["available"]}
    for name, env_rows in found.items():
        rows += [{**r, "target": f"{r['target']}@{name}", "environment": name} for r in env_rows
                 if r["available"] and r["target"] in runs_here or r["target"] == "*"]
    return rows


def _backend_of(target: str) -> str:
    return target.rpartition("-")[0]


def _missing_here(target: str) -> bool:
    backend = registry.load(_backend_of(target)).backend
    return backend is not None and backend.missing_package() is not None


def _rows_or_failure(env: Environment) -> list[dict[str, Any]]:
    try:
        return list(probe(env)["targets"])
    except RunError as exc:
        return [{"target": "*", "available": False, "reason": str(exc), "versions": {}, "devices": 0}]


def handed_down() -> dict[str, str]:
    """What an xbridge child in another interpreter takes from this one, whichever command starts it (a forwarded
    run, compile or check, parity's and compare's targets): the standard library the bundled text is read from
    (another Python's holds other text; xbridge/data/bundled.py)."""
    from .data.bundled import STDLIB_ROOT, stdlib_root

    return {STDLIB_ROOT: stdlib_root()}


def forward(env: Environment, argv: list[str]) -> int:
    """Run ``xbridge ARGV`` in ``env`` (its interpreter), this process waiting: its output is this command's output
    and its exit code this command's. The child has a process group of its own, so that Ctrl-C (SIGINT) and SIGTERM
    reach it once, passed on by this process (a terminal's Ctrl-C would otherwise reach it twice), which waits for it
    to stop (a warm server's fork where one serves it: xbridge/processes/warm.py). Where this process's stdout or
    stderr is not a file (the CLI called in-process, its streams captured), the child's output is written there."""
    cmd, child_env = [env.python, "-m", "xbridge", *argv], {**os.environ, **ALONE, **handed_down()}
    main = threading.current_thread() is threading.main_thread()     # only there can signals be handled
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    child: list[int] = []

    def pass_on(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError, IndexError):   # ended already, or not started
            os.kill(child[0], signum)

    try:
        for sig in previous:
            signal.signal(sig, pass_on)
        done = warm.run(cmd, child_env, started=child.append)
        if done is None:
            out, err = (_pipe_unless_file(stream) for stream in (sys.stdout, sys.stderr))
            proc = subprocess.Popen(cmd, env=child_env, stdout=out, stderr=err, text=True, process_group=0)
            child.append(proc.pid)
            done = subprocess.CompletedProcess(cmd, proc.returncode, *proc.communicate())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for text, stream in ((done.stdout, sys.stdout), (done.stderr, sys.stderr)):
        if text:
            stream.write(text)
            stream.flush()
    return done.returncode


def _pipe_unless_file(stream: Any) -> int:
    """The child's end for ``stream``: its own descriptor (sys.stdout's is a copy of the real stdout, not 1:
    xbridge/run/framework_noise.py), or a pipe where it has none."""
    try:
        descriptor = int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return subprocess.PIPE
    stream.flush()
    return descriptor


def add(name: str, python: str) -> dict[str, Any]:
    """Add (or replace) environment ``name`` in the file, after checking that xbridge answers there."""
    name = _checked_name(name.strip().lower(), "xbridge environments add")
    path = Path(python).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    env = Environment(name, str(path))
    found = probe(env)
    listed = _from_file()
    listed[name] = str(path)
    _write(listed)
    return {"name": name, "python": str(path), **found}


def remove(name: str) -> None:
    listed = _from_file()
    if name not in listed:
        raise ConfigError(f"environment {name!r} is not in {config_file()} (listed there: "
                          f"{', '.join(listed) or 'none'})")
    del listed[name]
    _write(listed)


def _write(listed: dict[str, str]) -> None:
    path = config_file()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"environments": listed}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
