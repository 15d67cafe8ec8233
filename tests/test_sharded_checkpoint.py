"""Sharded checkpoints (xbridge/checkpoint/shards.py): each process writes only the pieces it holds, process 0 commits
once all have written, and a reader reads only the pieces that overlap the slice it asks for, each checked against
its SHA-256. Two threads with a barrier stand in for two processes here; tests/test_processes.py runs the real
thing (two jax processes, one of them killed mid-save)."""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import pytest

from xbridge import checkpoint
from xbridge.checkpoint import shards
from xbridge.contract import PieceWriter
from xbridge.errors import CheckpointError
from xbridge.torch.weights import initial_weights


def _halves(array, index):
    """Process ``index``'s rows of ``array`` (split in two along its first axis), as the pieces it writes."""
    rows = array.shape[0] // 2
    return shards.Sharded(array.shape, str(array.dtype), [((rows * index,) + (0,) * (array.ndim - 1),
                                                           array[rows * index: rows * (index + 1)])])


def _save_as_two(directory, program, weights, step=3):
    """Two writers, one per "process": the weight matrices split by rows; the biases and the counter full arrays
    (each process has them; process 0 alone writes them)."""
    barrier = threading.Barrier(2)
    train = {"loop/updates": np.asarray(step, dtype=np.int64)}
    info = checkpoint.manifest_info(program, "jax-cpu", 4, {"data": 1, "model": 4}, step, {})
    results, errors = {}, []

    def process(index):
        try:
            writer = checkpoint.Writer(directory, keep=2, start_step=0)
            if index == 0:
                writer.lock()
            model = {n: _halves(a, index) if a.ndim == 2 else a for n, a in weights.items()}
            group = shards.Group(index, 2, lambda name: barrier.wait(timeout=60))
            pieces = PieceWriter(lambda folder: [shards.write_part(folder, group, model, train)], group)
            results[index] = writer.save_pieces(step, pieces, info)
        except Exception as exc:     # noqa: BLE001 (reported below)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == results[1] == checkpoint.step_dir(directory, step)
    return results[0]


@pytest.fixture
def saved(tmp_path, mlp_program):
    weights = initial_weights(mlp_program)
    return _save_as_two(tmp_path / "ck", mlp_program, weights), weights


def test_each_process_writes_its_share_and_process_0_commits(saved, mlp_program):
    path, weights = saved
    names = sorted(p.name for p in path.iterdir())
    assert names == ["COMMIT", "manifest.json", "model-00000-of-00002.safetensors",
                     "model-00001-of-00002.safetensors", "train-00000-of-00002.safetensors"]
    assert not list(path.parent.glob(".tmp-*"))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["processes"] == 2
    # each file holds its process's rows; the replicated biases only in process 0's
    matrix_bytes = sum(a.nbytes for a in weights.values() if a.ndim == 2)
    bias_bytes = sum(a.nbytes for a in weights.values() if a.ndim == 1)
    held = {f: sum(np.prod(s[1], dtype=int) * 4 for s in table.values()) for f, table in manifest["tensors"].items()}
    assert held["model-00001-of-00002.safetensors"] == matrix_bytes // 2
    assert held["model-00000-of-00002.safetensors"] == matrix_bytes // 2 + bias_bytes
    layout = manifest["layout"]["model"]["fc1.weight"]
    assert layout["shape"] == list(weights["fc1.weight"].shape)
    assert [(p["file"], p["start"]) for p in layout["pieces"]] == [
        ("model-00000-of-00002.safetensors", [0, 0]), ("model-00001-of-00002.safetensors", [128, 0])]
    loaded = checkpoint.load(path, mlp_program)
    assert loaded.step == 3 and int(np.asarray(loaded.train["loop/updates"])) == 3
    for name, array in weights.items():
        assert np.array_equal(np.asarray(loaded.weights[name]), array), name


def test_a_slice_reads_only_the_pieces_it_overlaps(saved, mlp_program, monkeypatch):
    path, weights = saved
    stored = checkpoint.load(path, mlp_program).weights["fc1.weight"]
    read = []
    original = shards.Stored._piece
    monkeypatch.setattr(shards.Stored, "_piece", lambda self, file, key, digest: (read.append(key),
                                                                                  original(self, file, key, digest))[1])
    assert np.array_equal(stored[200:256, 3:9], weights["fc1.weight"][200:256, 3:9])
    assert read == ["fc1.weight@128,0"]
    read.clear()
    assert np.array_equal(stored[100:140], weights["fc1.weight"][100:140])     # across the two pieces
    assert read == ["fc1.weight@0,0", "fc1.weight@128,0"]


def test_a_damaged_piece_is_named_when_it_is_read(saved, mlp_program):
    path, _ = saved
    file = path / "model-00001-of-00002.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF                      # the last tensor's bytes; the size (checked at load) is unchanged
    file.write_bytes(bytes(data))
    loaded = checkpoint.load(path, mlp_program)
    damaged = [n for n in loaded.weights if loaded.weights[n].ndim == 2]
    with pytest.raises(CheckpointError) as caught:
        for name in damaged:
            np.asarray(loaded.weights[name])
    assert f"checkpoint file {str(file)!r} is corrupted: piece" in str(caught.value)
    assert "differs from its SHA-256 in the manifest" in str(caught.value)


def _edit_layout(path, change):
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest["layout"]["model"]["fc1.weight"]["pieces"])
    text = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(text)
    (path / "COMMIT").write_text(f"sha256 {hashlib.sha256(text).hexdigest()}\n")


@pytest.mark.parametrize("change,said", [
    (lambda pieces: pieces.pop(), "the pieces of tensor 'fc1.weight' do not cover it"),
    (lambda pieces: pieces[1].update(start=[64, 0]), "the pieces of tensor 'fc1.weight' overlap"),
    (lambda pieces: pieces[1].update(start=[200, 0]), "lies outside tensor 'fc1.weight' [256, 64]"),
    (lambda pieces: pieces[1].update(key="nothing"), "names 'nothing' in 'model-00001-of-00002.safetensors', which"),
])
def test_a_layout_that_does_not_tile_its_tensor_is_refused(saved, mlp_program, change, said):
    path, _ = saved
    _edit_layout(path, change)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(path, mlp_program)
    assert said in str(caught.value)


def test_a_missing_or_truncated_part_file_is_refused_at_load(saved, mlp_program):
    path, _ = saved
    file = path / "model-00001-of-00002.safetensors"
    file.write_bytes(file.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="is truncated or padded"):
        checkpoint.load(path, mlp_program)
    file.unlink()
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load(path, mlp_program)


def test_a_dead_saves_folders_are_removed_by_the_next_save(tmp_path, mlp_program):
    weights = initial_weights(mlp_program)
    ck = tmp_path / "ck"
    ck.mkdir()
    stale = ck / ".tmp-step-00000003-999999-p1"
    stale.mkdir()
    (stale / "part-00001.json").write_text("{}")
    path = _save_as_two(ck, mlp_program, weights)
    assert not stale.exists() and checkpoint.load(path, mlp_program).step == 3
