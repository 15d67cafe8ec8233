"""The ``xbridge`` command line: ``app`` (the typer app, its subcommands registered in order, and ``main``), the
commands (``run_command``, ``target_commands``: compare and parity, ``info_commands``: cache, backends, inspect),
what they share (``common_options``, ``program_overrides``, ``backend_flags``: run's backend options), the tables
(``tables``) and the progress display (``progress``)."""

from __future__ import annotations

from .app import app, main

__all__ = ["app", "main"]
