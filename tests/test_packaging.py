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


def test_pins_are_exact_and_explained():
    text = (ROOT / "pyproject.toml").read_text()
    meta = tomllib.loads(text)["project"]["optional-dependencies"]
    assert "torch==2.9.0" in meta["eager"] and "torch_xla==2.9.0" in meta["xla"]
    assert "torch_xla 2.9.0 is built against torch 2.9.x" in text
    assert "torchax==0.0.13" in (ROOT / "scripts" / "setup.sh").read_text()
    assert "installs torchax==0.0.13 in a later, separate step" in text
    assert meta["tpu-compile"] == ["libtpu==0.0.22"] and "Mosaic IR version 8" in text
    assert ".[all,test,tpu-compile]" in (ROOT / "scripts" / "setup.sh").read_text()
