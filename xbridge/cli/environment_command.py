"""``xbridge environments``: the framework environments targets can run in (xbridge/environments.py): list them with
their Python and framework versions and targets, add one (checked by asking it what it runs) or remove one."""

from __future__ import annotations

from typing import Any

import typer

from ..errors import ConfigError
from .common_options import FORMAT, Format, emit


def environments(
    action: str = typer.Argument("list", help="list, add NAME PYTHON, or remove NAME."),
    name: str | None = typer.Argument(None, help="The environment's name (as in TARGET@NAME)."),
    python: str | None = typer.Argument(None, help="add: its Python interpreter (with xbridge installed)."),
    format: Format = FORMAT,
) -> None:
    """The environments xbridge starts targets in: this interpreter (``here``) and those added, each with its Python,
    framework versions and the targets it runs. A target runs here when it can, else in the first environment that
    can; TARGET@NAME picks one (e.g. inductor-cpu@xla, to race two torch versions)."""
    from .. import environments as envs
    from .tables import print_environments

    if action == "add":
        if not name or not python:
            raise ConfigError("xbridge environments add NAME PYTHON: give both (e.g. xbridge environments add xla "
                              ".venv-xla/bin/python)")
        envs.add(name, python)
    elif action == "remove":
        if not name or python:
            raise ConfigError("xbridge environments remove NAME: give the name only")
        envs.remove(name)
    elif action != "list" or name or python:
        raise ConfigError(f"xbridge environments {action!r}: the actions are list, add NAME PYTHON, remove NAME")
    emit(listing(), format, print_environments)


def listing() -> list[dict[str, Any]]:
    import platform
    import sys

    from .. import environments as envs
    from ..contract.registry import describe

    def summary(name: str, python: str, version: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        frameworks: dict[str, str] = {}
        for row in rows:
            frameworks.update({k: v for k, v in row.get("versions", {}).items() if k in envs.FRAMEWORKS})
        return {"name": name, "python": python, "python_version": version, "frameworks": frameworks,
                "targets": [row["target"] for row in rows if row["available"]]}

    out = [summary(envs.HERE, sys.executable, platform.python_version(), describe())]
    for env in envs.configured().values():
        found = envs.probe(env)
        out.append(summary(env.name, env.python, found["python"], found["targets"]))
    return out


def run_elsewhere(command_line: list[str], backend: str) -> None:
    """If ``backend`` names an environment (TARGET@NAME) or its backend's packages are not installed here but are in
    an environment, run this command line there and exit with its exit code; else return (it runs here, and a
    target that cannot gets its own error here)."""
    from .. import environments as envs

    env, target_text = envs.for_packages(backend)
    if env is not None:
        raise typer.Exit(envs.forward(env, with_backend(command_line, target_text)))


def with_backend(argv: list[str], target: str) -> list[str]:
    """``argv`` with its --backend/-b value replaced by ``target`` (the environment there runs it by that name)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--backend", "-b") and i + 1 < len(out):
            out[i + 1] = target
        elif arg.startswith("--backend="):
            out[i] = f"--backend={target}"
    return out
