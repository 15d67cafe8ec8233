"""The ``xbridge`` command line (``app``: the typer app, its commands and ``main``), its tables (``tables``) and
progress display (``progress``)."""

from __future__ import annotations

from .app import app, main

__all__ = ["app", "main"]
