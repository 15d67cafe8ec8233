"""--profile: the spec, and the summary read back from a Chrome/Perfetto trace (the traces every backend writes are
checked in tests/test_compare.py, which profiles every target)."""

from __future__ import annotations

import gzip
import json

import pytest

from xbridge.errors import ConfigError
from xbridge.run.profile import ProfileSpec, summarise


@pytest.mark.parametrize("text,message", [
    ("5:8", "--profile '5:8' is not steps=A:B"),
    ("steps=4:4", "the steps must satisfy A < B <= --steps (10)"),
    ("steps=8:12", "the steps must satisfy A < B <= --steps (10)"),
])
def test_a_bad_spec_is_named(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ProfileSpec.parse(text, 10)
    assert ProfileSpec.parse("steps=5:8", 10) == ProfileSpec(5, 8)


def test_the_summary_ranks_operations_and_splits_host_from_device(tmp_path):
    """A trace as jax and torch_xla write it: process lanes named in metadata, a device lane, step marks, Python
    frames (left out of the ranking)."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:TPU:0"}},
        {"ph": "X", "name": "xbridge step", "pid": 1, "tid": 1, "ts": 0, "dur": 5000, "args": {"step_num": "3"}},
        {"ph": "X", "name": "xbridge step", "pid": 1, "tid": 1, "ts": 6000, "dur": 4000, "args": {"step_num": "4"}},
        {"ph": "X", "name": "$train.py:10 step", "pid": 1, "tid": 1, "ts": 0, "dur": 9000},
        {"ph": "X", "name": "PjitFunction(step)", "pid": 1, "tid": 1, "ts": 10, "dur": 3000},
        {"ph": "X", "name": "fusion.12", "pid": 2, "tid": 7, "ts": 20, "dur": 2500},
        {"ph": "X", "name": "fusion.12", "pid": 2, "tid": 7, "ts": 6020, "dur": 2500},
        {"ph": "X", "name": "convolution", "pid": 2, "tid": 7, "ts": 3000, "dur": 400},
    ]
    folder = tmp_path / "plugins" / "profile" / "2026_11_30"
    folder.mkdir(parents=True)
    with gzip.open(folder / "vm.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    summary = summarise(tmp_path, ProfileSpec(3, 5))
    assert summary["traces"] == [str(folder / "vm.trace.json.gz")]
    assert summary["marked_steps"] == [3, 4] and summary["step_ms"] == [5.0, 4.0]
    assert [(op["name"], op["total_ms"], op["calls"]) for op in summary["top_ops"]] == [
        ("fusion.12", 5.0, 2), ("PjitFunction(step)", 3.0, 1), ("convolution", 0.4, 1)]
    assert summary["device_event_ms_per_step"] == 2.7 and summary["host_event_ms_per_step"] == 1.5


def test_no_trace_is_said(tmp_path):
    assert summarise(tmp_path, ProfileSpec(0, 1))["note"] == "the profiler wrote no trace file"
