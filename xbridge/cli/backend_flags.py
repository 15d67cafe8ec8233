"""The backend options on ``run``'s command line (``--sharding-mode``, ``--xla-mode``, ...): not declared here but by
each installed backend (xbridge.contract.BackendOption); ``run`` accepts exactly the declared flags and lists them at
the end of its help."""

from __future__ import annotations

import difflib
from typing import Any

import click
import typer
from typer.core import TyperCommand

from ..errors import ConfigError


def parse_backend_flags(ctx: typer.Context) -> dict[str, str]:
    """``--NAME VALUE`` / ``--NAME=VALUE`` pairs left over by the fixed options: each must be an option some
    installed backend declares (its values are checked against the target's own options later)."""
    from ..contract.registry import all_options

    declared = all_options()
    given: dict[str, str] = {}
    items = iter(ctx.args)
    for item in items:
        flag, sep, value = item.partition("=")
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if name not in declared:
            if not flag.startswith("-"):
                raise ConfigError(f"Got unexpected extra argument ({item}) (see `{ctx.command_path} --help`)")
            flags = [o for p in ctx.command.params for o in p.opts] + [o.flag for o in declared.values()]
            close = difflib.get_close_matches(flag, flags, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(f"No such option: {flag}.{hint} (see `{ctx.command_path} --help`)")
        if not sep:
            value = next(items, "")
            if not value or value.startswith("--"):
                raise ConfigError(f"option {flag} needs a value ({', '.join(declared[name].choices)})")
        given[name] = value
    return given


def options_epilog() -> list[str]:
    """The backend options, for ``run --help``: read from the installed backends' declarations."""
    from ..contract import registry

    lines = []
    for name in registry.backend_names():
        backend = registry.load(name).backend
        for option in backend.options if backend is not None else ():
            lines.append(f"{option.flag} {{{'|'.join(option.choices)}}} ({name} only; default {option.default}): "
                         f"{option.help}")
    return lines


class WithBackendOptions(TyperCommand):
    """``run --help`` ends with the options the installed backends declare (read only when help is shown)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super().format_help(ctx, formatter)     # typer prints its rich help itself
        lines = options_epilog()
        if lines:
            click.echo("\n Backend options (checked against the target's own):")
            for line in lines:
                click.echo(f"   {line}")
