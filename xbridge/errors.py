"""Errors a user can act on. Each carries one line that names the thing at fault and how to fix it.

The CLI prints ``error: <message>`` and exits with ``exit_code`` (2 for bad input); ``XBRIDGE_DEBUG=1`` shows the
traceback instead.
"""

from __future__ import annotations


class XBridgeError(Exception):
    """Base of every error caused by the user's input or environment."""

    exit_code = 2


class ConfigError(XBridgeError, ValueError):
    """A field of the program IR (precision, optimizer, mesh, data, step options) is invalid."""


class DataError(ConfigError):
    """A data source gave a batch the program cannot use (missing key, changed shape, non-array value, a token id
    outside the vocabulary, a file that changed). Names the source, the step and the key."""


class ProgramError(XBridgeError):
    """A program file cannot be loaded or does not define a valid ``program``."""


class PlanError(XBridgeError, ValueError):
    """The mesh or the sharding rules do not fit the model or the device count."""


class TargetError(XBridgeError, ValueError):
    """A target string is malformed or names no known backend/device."""


class BackendUnavailable(XBridgeError):
    """The target is known but cannot run here (missing package, no such device)."""


class RunError(XBridgeError):
    """A run failed for a reason the user can act on (for example a non-finite loss)."""

    exit_code = 1


class NonFinite(RunError):
    """A checkpoint piece about to be written holds NaN or Inf (the checkpoint writer names the step it refused)."""


class LoweringError(XBridgeError):
    """A backend cannot lower something in the program (an operator, a construct). Names the op and module."""

    exit_code = 1


class CheckpointError(XBridgeError):
    """A checkpoint cannot be written or loaded: another program's, corrupted, truncated, incomplete, or a
    directory that cannot hold it. Nothing is loaded and nothing is overwritten."""


class Interrupted(XBridgeError):
    """Ctrl-C during a run; with checkpointing on, a final checkpoint was written first."""

    exit_code = 130


class Terminated(Interrupted):
    """SIGTERM during a run (what Slurm, Kubernetes and TPU maintenance send before a kill), handled as Ctrl-C is:
    with checkpointing on, a final checkpoint was written first. Exit 143 (128 + 15), as the signal's own would be."""

    exit_code = 143


class TermSignal(BaseException):
    """Raised by xbridge's SIGTERM handler in the main thread, so that every ``finally`` runs and the process ends
    with one line and exit 143 instead of dying silently (cli/app.py installs the handler). Not a KeyboardInterrupt:
    typer turns that into a silent exit 130; not an Exception: nothing that handles errors may swallow it."""


SIGNAL_EXIT = {2: 130, 15: 143}      # SIGINT, SIGTERM: the exit status of a command they stopped


def raise_term_signal(signum: int, frame: object) -> None:
    """The SIGTERM handler: the signal becomes :class:`TermSignal` in the main thread."""
    raise TermSignal()
