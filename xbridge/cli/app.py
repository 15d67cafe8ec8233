"""The ``xbridge`` command and its subcommands. Bad input prints one ``error:`` line and exits 2;
``XBRIDGE_DEBUG=1`` shows tracebacks.

The commands are in their own modules: ``run`` (run_command.py, its backend flags in backend_flags.py), ``compare``
and ``parity`` (target_commands.py), ``check``, ``cache``, ``backends`` and ``inspect`` (info_commands.py); the
options they share in common_options.py. Here they are registered, in the order ``--help`` lists them, each with its
example, and :func:`main` turns what they raise into one error line and an exit code."""

from __future__ import annotations

import contextlib
import errno
import inspect as pyinspect
import os
import signal
import sys
import threading
import typing
from pathlib import Path

import typer

from ..errors import SIGNAL_EXIT, ConfigError, TermSignal, XBridgeError, raise_term_signal
from ..files import release_claims
from . import run_command
from .backend_flags import WithBackendOptions
from .compile_command import compile_command
from .environment_command import environments
from .info_commands import backends, cache, check, inspect
from .run_command import run
from .target_commands import compare, parity

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Write a PyTorch training program once; run, match and race it on every compiler stack.")

# The subcommands, in the order --help lists them, each with its example
app.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
            epilog="Example: xbridge run programs/gpt.py --backend eager-cpu --steps 50 --out out/gpt\n\n"
            "Checkpoints: xbridge run programs/gpt.py --backend jax-cpu --steps 100 --checkpoint-every 20 "
            "--checkpoint-dir ckpt\n\n"
            "Resume: xbridge run programs/gpt.py --backend xla-cpu --steps 200 --resume ckpt --checkpoint-dir ckpt",
            cls=WithBackendOptions)(run)
app.command(epilog="Example: xbridge compare programs/gpt.py --backends eager-cpu,jax-cpu --steps 20 --out "
                   "out/compare")(compare)
app.command(epilog="Example: xbridge parity programs/mlp.py --backends jax-cpu,xla-cpu --devices 4 --mesh "
                   "data=-1,model=2 --bisect")(parity)
app.command("compile", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
            epilog="Example: xbridge compile programs/gpt.py --backend jax-tpu --topology v5e-8 --precision "
                   "bf16-mixed\n\nFit: xbridge compile programs/gpt.py --topology v5e-8 --fit",
            cls=WithBackendOptions)(compile_command)
app.command(epilog="Example: xbridge check programs/gpt.py --backends jax-cpu,xla-cpu,inductor-cpu,jax-tpu")(check)
app.command(epilog="Example: xbridge cache --clear inductor")(cache)
app.command(epilog="Example: xbridge backends --format json")(backends)
app.command(epilog="Example: xbridge environments add torch29 /opt/torch29/bin/python")(environments)
app.command(epilog="Example: xbridge inspect programs/gpt.py --devices 8 --mesh data=-1,model=2")(inspect)


def _refuse_empty_values(args: list[str]) -> None:
    """A path option given an empty value (``--out ""``, ``--checkpoint-dir=``) is refused: it would mean the current
    folder, which nobody means by typing nothing. The path options are read off each command's signature."""
    command = next((info.callback for info in app.registered_commands if args and info.callback is not None
                    and (info.name or info.callback.__name__.replace("_", "-")) == args[0]), None)
    if command is None:
        return
    hints = typing.get_type_hints(command)
    paths = set()
    for name, parameter in pyinspect.signature(command).parameters.items():
        if Path in (hints.get(name), *typing.get_args(hints.get(name))):
            declared = [d for d in getattr(parameter.default, "param_decls", None) or () if d.startswith("--")]
            paths.update(declared or [f"--{name.replace('_', '-')}"])
    for index, arg in enumerate(args[1:], start=1):
        name, equals, value = arg.partition("=")
        empty = not value if equals else (index + 1 < len(args) and not args[index + 1])
        if name in paths and empty:
            raise ConfigError(f"{name} is given an empty value; give a path (. for the current folder)")


_RESOURCE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EROFS}


def _error(text: str) -> None:
    """The one error line, on stderr; also in ``XBRIDGE_ERROR_FILE`` where a supervisor set it (a process it
    restarts said why it failed: the restart's record names that, xbridge/processes/restarts.py)."""
    print(f"error: {text}", file=sys.stderr)
    from ..processes.restarts import ERROR_FILE

    where = os.environ.get(ERROR_FILE)
    if where:
        with contextlib.suppress(OSError):
            Path(where).write_text(text + "\n", encoding="utf-8")


def _resource_error(exc: OSError) -> None:
    where = f" on {exc.filename!r}" if exc.filename else ""
    _error(f"{exc.strerror}{where} (errno {exc.errno}); free the resource or choose another path "
           "(XBRIDGE_DEBUG=1 shows the traceback)")
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """The command line: one line and an exit status for everything that goes wrong. SIGTERM ends a command as
    Ctrl-C does (errors.TermSignal); the handler there before is back when main returns (tests call main in their
    own process)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_term_signal) if main_thread else None
    try:
        _main(argv)
    finally:
        release_claims()        # the output folders this command held (files.claim)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> None:
    run_command.COMMAND_LINE[:] = list(argv) if argv is not None else sys.argv[1:]
    from ..run import framework_noise

    framework_noise.silence()
    framework_noise.native_stdout_to_stderr()
    debug = os.environ.get("XBRIDGE_DEBUG", "") not in ("", "0")
    try:
        _refuse_empty_values(sys.argv[1:] if argv is None else argv)
        code = app(args=argv, prog_name="xbridge", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _error("interrupted")
        sys.exit(SIGNAL_EXIT[signal.SIGINT])
    except TermSignal:
        _error("terminated by SIGTERM")
        sys.exit(SIGNAL_EXIT[signal.SIGTERM])
    except typer.TyperException as exc:  # usage errors: unknown option, missing argument, bad value
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "xbridge"
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(message, file=sys.stderr)
        else:
            _error(f"{message} (see `{command} --help`)")
        sys.exit(getattr(exc, "exit_code", 2))
    except XBridgeError as exc:
        if debug:
            raise
        _error(str(exc))
        sys.exit(exc.exit_code)
    except Exception as exc:
        if debug:
            raise
        from ..processes import after_lost_peer

        after_lost_peer(exc)        # a peer process died: its supervisor names it, not this echo of it
        if isinstance(exc, MemoryError):   # the environment: exit 1, the resource named
            _error("out of host memory (MemoryError); use a smaller model or batch, fewer --jobs, or a machine "
                   "with more memory")
            sys.exit(1)
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:    # disk full, quota, I/O: wherever raised
            _resource_error(exc)
        from ..program_file import failure_line

        located = failure_line(exc)
        if located is not None:     # the user's program raised (exit 2), or the stack failed on its code (exit 1)
            _error(located[0])
            sys.exit(located[1])
        if isinstance(exc, OSError) and exc.strerror:
            _resource_error(exc)
        _error(f"{type(exc).__name__}: {exc} (XBRIDGE_DEBUG=1 shows the traceback)")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
