"""Load a program file: ``path.py`` (its ``program``) or ``path.py:NAME``."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

from .errors import ProgramError, XBridgeError
from .program import Program


def load_program(ref: str) -> Program:
    path_text, _, attr = ref.partition(":") if not Path(ref).exists() else (ref, "", "")
    attr = attr or "program"
    path = Path(path_text)
    if not path.exists():
        raise ProgramError(f"program file {path_text!r} does not exist; pass the path of a .py file that defines "
                           "`program = xb.Program(...)` (see programs/)")
    if not path.is_file():
        raise ProgramError(f"program path {path_text!r} is not a file")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProgramError(f"program file {path_text!r} cannot be read: {exc}") from None
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ProgramError(f"program file {path_text!r} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    module_name = f"xbridge_program_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except XBridgeError as exc:
        raise type(exc)(f"{path_text}: {exc}") from exc
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise ProgramError(f"program file {path_text!r} raised {type(exc).__name__} at import "
                           f"({Path(frame.filename).name}:{frame.lineno}): {exc}") from exc
    if not hasattr(module, attr):
        raise ProgramError(f"program file {path_text!r} defines no `{attr}`; add `{attr} = xb.Program(...)`")
    program = getattr(module, attr)
    if not isinstance(program, Program):
        raise ProgramError(f"`{attr}` in {path_text!r} is a {type(program).__name__}, not an xb.Program; "
                           f"assign `{attr} = xb.Program(...)`")
    return program
