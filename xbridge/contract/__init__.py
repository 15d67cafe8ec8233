"""The contract between the core and a backend plugin (docs/adding-a-backend.md lists all of it).

A plugin registers a :class:`Backend` subclass (backend.py) in the entry-point group ``xbridge.backends``; its
:meth:`Backend.lower` returns an :class:`Executable` (executable.py: the eight methods every backend implements or
inherits), which may declare capabilities by subclassing the classes of capabilities.py (diagnostics, profiling,
probes, sharded checkpoints, several processes). registry.py finds the plugins.
"""

from .backend import Backend, BackendOption, Target
from .capabilities import STEP_MARK, Diagnostics, MultiProcess, PieceWriter, Probes, Profiling, ShardedCheckpoint
from .executable import CompileCache, Executable, on_host

__all__ = ["Backend", "BackendOption", "CompileCache", "Diagnostics", "Executable", "MultiProcess", "PieceWriter",
           "Probes", "Profiling", "STEP_MARK", "ShardedCheckpoint", "Target", "on_host"]
