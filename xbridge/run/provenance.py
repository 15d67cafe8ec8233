"""Where a run came from: the command line, the program file, and the git commit of the program's folder (with a
dirty flag: uncommitted changes under that folder), so a result can be traced to the code that produced it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from ..ir.program import Program
from ..program_file import source_of

__all__ = ["git_state", "provenance"]


def provenance(program: Program) -> dict[str, Any]:
    source = source_of(program)
    file = source[0] if source else None
    launcher = Path(sys.argv[0]).name
    launcher = "xbridge" if launcher == "__main__.py" else launcher      # python -m xbridge
    return {"command": [launcher, *sys.argv[1:]], "program_file": file,
            "git": git_state(Path(file).parent) if file else None}


def git_state(folder: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty", "root"}`` of the git work tree holding ``folder``; None outside one (or without git)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return {"commit": commit, "dirty": bool(changes), "root": git("rev-parse", "--show-toplevel")}
