"""The checkpoint format: the names of its files and folders, the manifest's program fields and the hash that
decides whether a checkpoint resumes a program, and finding the checkpoints of a directory.

A checkpoint is a directory ``step-NNNNNNNN`` (the number of completed optimizer steps) holding

- ``model.safetensors``: parameters and buffers, full (unsharded) arrays under the eager state_dict names;
- ``train.safetensors``: everything else the next step depends on, under backend-neutral names:
  ``optim/<param>/<key>`` (torch.optim's per-parameter keys: ``step``, ``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer``), ``loop/updates`` (the schedule's count), ``scaler/*`` (dynamic loss scaling) and
  ``rng/*`` (framework RNG states);
- ``manifest.json``: step, data position, program config and its hashes, precision, target, mesh, versions, and
  the size and SHA-256 of both tensor files;
- ``COMMIT``: the SHA-256 of ``manifest.json``, written last: a manifest edited or damaged afterwards is refused.

A sharded checkpoint (shards.py) holds per-process ``model-IIIII-of-PPPPP`` and ``train-IIIII-of-PPPPP``
safetensors files instead of the two, and a ``layout`` in its manifest.

Floating arrays are stored in float32 (exact for bf16 and fp16 state; the manifest records the dtype the run kept
them in). Nothing is pickled: safetensors holds only a JSON header and raw bytes, so loading never runs code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..ir import serialize
from ..ir.program import Program

FORMAT = "xbridge-checkpoint"
VERSION = 1
MODEL_FILE, TRAIN_FILE, MANIFEST, COMMIT = "model.safetensors", "train.safetensors", "manifest.json", "COMMIT"
LOCK = ".lock"
STEP_NAME = re.compile(r"^step-(\d{8,})$")     # a checkpoint's directory; the number is its step (8 digits or more)


def resume_hash(program: Program) -> str:
    """The config hash without the mesh and the sharding rules, which change where arrays live, and without the
    step's scan over layers and remat, which change how the step is compiled: none changes the arithmetic, so a
    checkpoint resumes under another mesh (resharding on load), scanned or unrolled, with or without remat."""
    return serialize.config_hash(program, leave_out=("mesh", "sharding", "step.scan_layers", "step.remat",
                                                     "step.layers"))


def manifest_info(program: Program, target: str, devices: int, mesh: dict[str, int], step: int,
                  versions: dict[str, str]) -> dict[str, Any]:
    return {"program": program.name, "config_hash": program.config_hash, "resume_hash": resume_hash(program),
            "config": program.config(), "precision": program.precision.name,
            "data": {"next_batch": step, "seed": program.seed, "batch_size": program.data.batch_size},
            "target": target, "devices": devices, "mesh": mesh, "versions": versions}


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory`` (renamed into place, manifest present), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = STEP_NAME.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def locate(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the newest checkpoint in the directory ``path``."""
    if (path / MANIFEST).is_file():
        _refuse_link(path, "--resume")
        return path
    if not path.exists():
        raise CheckpointError(f"--resume {str(path)!r} does not exist")
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {str(path)!r} holds no checkpoint (no step-NNNNNNNN/{MANIFEST})")
    _refuse_link(found[-1][1], "--resume")
    return found[-1][1]


def _refuse_link(path: Path, flag: str) -> None:
    if path.is_symlink():
        raise CheckpointError(f"{flag}: checkpoint {str(path)!r} is a symbolic link; xbridge deletes old checkpoints "
                              "and never through a link: copy the checkpoint there instead")
