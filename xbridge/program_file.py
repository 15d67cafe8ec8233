"""Load a program file: ``path.py`` (its ``program``) or ``path.py:NAME``.

The loader records where each program came from (:func:`source_of`), so a backend that loads the program again in
other processes finds the file without guessing from module names. The module's name is derived from the file's
path with SHA-256, never with ``hash()`` (salted per process): compilers put the name of the module that holds
``torch`` into cache keys, and a name that changed per process made every compile cache miss (issue #20)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from .errors import ProgramError, XBridgeError
from .ir.program import Program

# (file, attribute, program) of every program loaded in this process, oldest first
_LOADED: list[tuple[str, str, Program]] = []


def module_name_for(path: Path) -> str:
    """The module name a program file is loaded under: the same in every process and on every run."""
    # os.fsencode: a path's own bytes (a name that is not UTF-8 holds surrogates that str.encode refuses)
    return "xbridge_program_" + hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:16]


def source_of(program: Program) -> tuple[str, str] | None:
    """The program file and attribute ``program`` (or a ``replace``d copy of it: same model and loss, the loss
    perhaps wrapped by xbridge, e.g. for --rng portable) came from."""
    loss = getattr(program.loss, "user_loss", program.loss)
    for file, attr, loaded in reversed(_LOADED):
        if loaded.model is program.model and loaded.loss is loss:
            return file, attr
    return None


def split_ref(ref: str) -> tuple[str, str]:
    """``FILE.py`` or ``FILE.py:NAME`` -> (file, attribute). A path that exists is taken whole (a ``:`` in a folder
    or file name stays in it); otherwise the text after the last ``:`` is the attribute when it is an identifier."""
    if Path(ref).exists():
        return ref, "program"
    head, sep, tail = ref.rpartition(":")
    if sep and tail.isidentifier():
        return head, tail
    return ref, "program"


# Exceptions of these packages, raised inside them, are the stack failing while it runs the user's code (a lowering
# that cannot handle a traced array), not the user's mistake: cli/app.py says so, exit 1.
STACKS = ("jax", "jaxlib", "torchax", "torch_xla")


def stack_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a compiler stack's own failure: an exception type of one of :data:`STACKS`, raised in
    that stack's code (its innermost frame is not the user's: a program that calls ``np.asarray`` on a traced
    tensor itself raises the same type in its own frame, and that is its mistake)."""
    if type(exc).__module__.partition(".")[0] not in STACKS:
        return False
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return bool(frames) and not _is_user(frames[-1].f_code.co_filename)


@functools.cache
def _not_users() -> tuple[Path, ...]:
    """xbridge, its backends, the standard library and the installed packages (found once per process)."""
    import sysconfig

    found = [Path(__file__).resolve().parent]
    found += [Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    spec = importlib.util.find_spec("xbridge.backends")
    if spec is not None and spec.origin:
        found.append(Path(spec.origin).resolve().parent)
    return tuple(found)


def _is_user(filename: str) -> bool:
    """A file outside xbridge, its backends, the standard library and installed packages."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(folder) for folder in _not_users())


def user_frame(exc: BaseException) -> tuple[traceback.FrameSummary, str] | None:
    """Where ``exc`` was raised in the user's code, and what of the program was running: the innermost frame of its
    traceback outside xbridge, the standard library and installed packages, and the role of the outermost such frame
    ("loss", "model builder", "data source" of a loaded program, else "code"). None when the failure never reached
    the user's code."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    summaries = traceback.extract_tb(exc.__traceback__)     # the same frames, in the same order
    mine = [i for i, frame in enumerate(frames) if _is_user(frame.f_code.co_filename)]
    if not mine:
        return None
    return summaries[mine[-1]], _role(frames[mine[0]].f_code)


def failure_line(exc: BaseException) -> tuple[str, int] | None:
    """The CLI's line for an exception raised in the user's code, and its exit code: the user's own mistake (2),
    or a compiler stack failing on the user's code (1, :func:`stack_failure`). None when it never reached the
    user's code."""
    found = user_frame(exc)
    if found is None:
        return None
    where, role = found
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if stack_failure(exc):
        return (f"{type(exc).__name__} inside {type(exc).__module__.partition('.')[0]} while it ran the program's "
                f"{role} at {where.filename}:{where.lineno} (in {where.name}): {message}; the compiler stack failed, "
                "not the program: run it on another backend (xbridge check names one) or report it "
                "(XBRIDGE_DEBUG=1 shows the traceback)"), 1
    return (f"{type(exc).__name__}{': ' + message if message else ''} raised in the program's {role} at "
            f"{where.filename}:{where.lineno} (in {where.name}); XBRIDGE_DEBUG=1 shows the traceback"), 2


def _role(code: object) -> str:
    """What part of a loaded program ``code`` (a function's code object) is."""
    def code_of(fn: object) -> object:
        fn = getattr(fn, "__func__", fn)
        if isinstance(fn, type):
            fn = vars(fn).get("__init__", None)      # a model class: its own __init__
        return getattr(fn, "__code__", None)

    for _, _, program in _LOADED:
        loss = getattr(program.loss, "user_loss", program.loss)
        sources = [program.data] + ([program.eval.data] if program.eval is not None else [])
        if code is code_of(loss):
            return "loss"
        if code is code_of(program.model):
            return "model builder"
        if any(code is code_of(getattr(type(source), "batch", None)) for source in sources):
            return "data source"
    return "code"


def load_program(ref: str) -> Program:
    path_text, attr = split_ref(ref)
    path = Path(path_text)
    if not path.exists():
        raise ProgramError(f"program file {path_text!r} does not exist; pass the path of a .py file that defines "
                           "`program = xb.Program(...)` (see programs/)")
    if not path.is_file():
        raise ProgramError(f"program path {path_text!r} is not a file")
    try:
        source = path.read_bytes()     # bytes: compile() honours a PEP 263 coding line, as `python FILE` does
    except OSError as exc:
        raise ProgramError(f"program file {path_text!r} cannot be read: {exc}") from None
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ProgramError(f"program file {path_text!r} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except (UnicodeDecodeError, ValueError) as exc:    # not UTF-8 and no coding line, or NUL bytes
        raise ProgramError(f"program file {path_text!r} cannot be read as Python source: {exc}") from None
    folder = str(path.resolve().parent)
    if folder not in sys.path:      # as `python FILE` does: a module beside the program imports (`from netdef ...`)
        sys.path.insert(0, folder)
    module_name = module_name_for(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except XBridgeError as exc:
        raise type(exc)(f"{path_text}: {exc}") from exc
    except SystemExit as exc:
        raise ProgramError(f"program file {path_text!r} called sys.exit({exc.code!r}) at import; a program file "
                           "defines `program = xb.Program(...)` and leaves running to xbridge") from None
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ProgramError(f"program file {path_text!r} raised {type(exc).__name__} at import "
                           f"({Path(frame.filename).name}:{frame.lineno}): {exc}") from exc
    try:
        program = getattr(module, attr)   # a module-level __getattr__ may build it now
    except AttributeError:
        raise ProgramError(f"program file {path_text!r} defines no `{attr}`; add `{attr} = xb.Program(...)`") from None
    except XBridgeError as exc:
        raise type(exc)(f"{path_text}: {exc}") from exc
    if not isinstance(program, Program):
        raise ProgramError(f"`{attr}` in {path_text!r} is a {type(program).__name__}, not an xb.Program; "
                           f"assign `{attr} = xb.Program(...)`")
    _LOADED.append((str(path.resolve()), attr, program))
    return program
