"""The process setup compiling for a TPU needs, before JAX loads libtpu (bench/results/tpu-aot/NOTES.md, sections 1
and 6): the process's own JAX backend stays the CPU (JAX would otherwise try to start a TPU runtime), libtpu is
told it has no TPU host to look for when the PCI bus shows no TPU chip (or it prints five lines of warnings about
worker hostnames), and its path is found from the ``libtpu`` distribution."""

from __future__ import annotations

import glob
import importlib.util
import os

from ..errors import BackendUnavailable

GOOGLE_PCI_VENDOR = "0x1ae0"
INSTALL = "pip install 'xbridge[tpu-compile]' (make setup installs it)"


def tpu_chips_on_this_machine() -> int:
    """TPU chips on the PCI bus (Google's vendor id), as jax's own ``hardware_utils`` counts them; nothing loads."""
    found = 0
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                found += f.read().strip() == GOOGLE_PCI_VENDOR
        except OSError:
            continue
    return found


def libtpu_available() -> bool:
    return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def prepare_process() -> None:
    """Before the first ``import jax`` of a process that compiles for a TPU it does not have."""
    if not libtpu_available():
        raise BackendUnavailable(f"compiling for a TPU needs libtpu, the TPU compiler, which is not installed: "
                                 f"{INSTALL}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")    # this process runs nothing: its own backend is the CPU
    if tpu_chips_on_this_machine() == 0:
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
        # compile-only: several processes may load libtpu at once (compare's rows, the tests); without this the
        # second fails on libtpu's lock file (/tmp/libtpu_lockfile), which guards the chips there are none of
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compile_note(target: str) -> str:
    """What ``xbridge backends`` adds to a TPU target's "not here": that it can still be compiled for, or how."""
    if libtpu_available():
        return f"; it can compile for one here: xbridge compile PROG --backend {target} --topology v5e-8"
    return f"; to compile for one here without running: {INSTALL}"
