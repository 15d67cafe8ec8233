"""The contract between the core and a backend plugin (docs/adding-a-backend.md lists all of it).

A plugin registers a :class:`Backend` subclass (backend.py) in the entry-point group ``xbridge.backends``; its
:meth:`Backend.lower` returns an :class:`Executable` (executable.py: the ten methods every backend implements or
inherits), which may declare capabilities by subclassing the classes of capabilities.py (diagnostics, profiling,
probes, sharded checkpoints, several processes) or hand them to collaborators (``Executable.parts``). registry.py
finds the plugins. What else of xbridge a plugin may import: xbridge/plugin.py.
"""

from .backend import Backend, BackendOption, Target
from .capabilities import STEP_MARK, Diagnostics, MultiProcess, PieceWriter, Probes, Profiling, ShardedCheckpoint
from .executable import CompileCache, Executable, on_host

__all__ = ["Backend", "BackendOption", "CompileCache", "Diagnostics", "Executable", "MultiProcess", "PieceWriter",
           "Probes", "Profiling", "STEP_MARK", "ShardedCheckpoint", "Target", "on_host"]
