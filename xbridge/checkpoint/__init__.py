"""Portable checkpoints: one format for every backend, written atomically, verified before anything is loaded.

- format.py: what a checkpoint is (its files, the manifest's program fields, the resume hash) and finding the
  checkpoints of a directory;
- writer.py: :class:`Writer`, which saves a run's checkpoints (the directory's lock, atomic saves whole or in
  pieces, the sharded commit, pruning);
- reader.py: :func:`load`, which verifies a checkpoint and reads it back;
- shards.py: a sharded checkpoint's pieces, as each process writes them and as tensors read slice by slice.

The run loop (xbridge/run/loop.py) decides when to save and what to resume; each backend only exports and imports
its state (docs/checkpoints.md).
"""

from .format import (
    COMMIT,
    FORMAT,
    MANIFEST,
    MODEL_FILE,
    TRAIN_FILE,
    VERSION,
    list_checkpoints,
    locate,
    manifest_info,
    resume_hash,
    step_dir,
)
from .reader import Checkpoint, config_changes, load
from .shards import Group, Sharded, Stored
from .writer import Writer

__all__ = ["COMMIT", "FORMAT", "MANIFEST", "MODEL_FILE", "TRAIN_FILE", "VERSION", "Checkpoint", "Group", "Sharded",
           "Stored", "Writer", "config_changes", "list_checkpoints", "load", "locate", "manifest_info", "resume_hash",
           "step_dir"]
