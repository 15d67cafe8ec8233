"""The built wheel: backends installed as xbridge.backends.*, never as a bare top-level package; entry points
and pins as the design asks."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_wheel_layout_and_entry_points(tmp_path):
    # no build isolation: the environment's setuptools builds it, with no package registry needed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = tmp_path.glob("xbridge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "xbridge/backends/eager/__init__.py" in names and "xbridge/backends/eager/executable.py" in names
    assert "xbridge/aot/compile.py" in names and "xbridge/backends/jaxjit/ahead_of_time.py" in names
    assert not [n for n in names if n.startswith(("backends/", "programs/", "tests/"))]
    top = {n.split("/")[0] for n in names}
    assert not top & {"jax", "torch_xla", "torchax", "torch", "backends"}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[xbridge.backends]\neager = xbridge.backends.eager:EagerBackend" in text
    assert "xbridge = xbridge.cli:main" in text


def test_only_what_must_be_pinned_is_pinned_and_explained():
    """torch and jax are ranges (installing xbridge keeps the ones an environment has); torch_xla pins torch (its
    wheel is built against 2.9.x), which puts xla in an environment of its own, outside `all`; torchax is held to the
    two versions the jax plugin's patches are written for; libtpu follows the Python version's jax line; make setup's
    .venv (Python 3.12) takes today's frameworks from scripts/pins.txt, .venv-xla (3.11) torch 2.9's from
    scripts/pins-xla.txt, as constraints."""
    text = (ROOT / "pyproject.toml").read_text()
    meta = tomllib.loads(text)["project"]["optional-dependencies"]
    assert "torch>=2.9,<2.16" in meta["eager"] and "jax>=0.7.1,<0.13,!=0.12.1" in meta["jax"]
    assert "only 0.12.1 hangs" in text
    assert {"torch==2.9.0", "torch_xla==2.9.0"} <= set(meta["xla"]) and "xla" not in meta["all"][0]
    assert "It is built\n# against torch 2.9.x and only imports with it" in text
    assert "torchax>=0.0.13,<=0.0.14.dev20261026" in meta["jax"] and "patches of its private operator table" in text
    assert meta["tpu-compile"] == ["libtpu==0.0.50.*; python_version >= '3.12'", "libtpu==0.0.22; python_version < '3.12'"]
    assert "Mosaic IR version 8" in text and "jax[tpu]==0.12.0 asks for libtpu 0.0.50.*" in text
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"$(python_for 3.12)" "all,test,tpu-compile" -c "$PINS"' in setup
    assert '"$(python_for 3.11)" "xla,tensorboard,test,tpu-compile" -c "$XLA_PINS"' in setup
    assert "environments add xla" in setup
    pins = (ROOT / "scripts" / "pins.txt").read_text().split()
    assert {"torch==2.14.1", "jax==0.12.0.1", "torchax==0.0.14.dev20261026", "libtpu==0.0.50.1"} <= set(pins)
    xla_pins = (ROOT / "scripts" / "pins-xla.txt").read_text().split()
    assert {"torch==2.9.0", "jax==0.7.1", "torchax==0.0.13", "libtpu==0.0.22"} <= set(xla_pins)
