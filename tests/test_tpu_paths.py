"""The TPU- and GPU-specific branches, run on a CPU with the inputs an accelerator's runtime would give them (its
device-kind strings, its device files, its runtime answers). Nothing here pretends a TPU ran: docs/results.md says
what has run on which hardware."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from xbridge.compare import peaks
from xbridge.compare.job import _peak_for


# The device kinds as PJRT reports them (jax.devices()[0].device_kind; torch_xla's xm.xla_device_kind is the same
# PJRT string), and torch.cuda.get_device_name's names.
@pytest.mark.parametrize("kind,dtype,flops,source", [
    ("TPU v4", "bfloat16", 275e12, "datasheet tpu v4 bfloat16"),
    ("TPU v5 lite", "bfloat16", 197e12, "datasheet tpu v5 lite bfloat16"),     # v5e
    ("TPU v5e", "bfloat16", 197e12, "datasheet tpu v5e bfloat16"),
    ("TPU v5", "bfloat16", 459e12, "datasheet tpu v5 bfloat16"),               # v5p
    ("TPU v5p", "bfloat16", 459e12, "datasheet tpu v5p bfloat16"),
    ("TPU v6 lite", "bfloat16", 918e12, "datasheet tpu v6 bfloat16"),          # v6e (Trillium)
    ("TPU v6e", "bfloat16", 918e12, "datasheet tpu v6e bfloat16"),
    ("TPU v5litepod", "bfloat16", 197e12, "datasheet tpu v5litepod bfloat16"),  # torch_xla's accelerator type
    ("TPU v5 lite", "float32", 197e12, "datasheet tpu v5 lite bfloat16 (no float32 figure)"),
    ("NVIDIA H200", "bfloat16", 989.4e12, "datasheet h200 bfloat16"),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12, "datasheet h100 bfloat16"),
    ("NVIDIA A100-SXM4-80GB", "float32", 19.5e12, "datasheet a100 float32"),
    ("NVIDIA L4", "float16", 121e12, "datasheet l4 float16"),
])
def test_known_device_kinds_get_their_datasheet_peak(kind, dtype, flops, source):
    peak = peaks.known_peak(kind, dtype)
    assert peak is not None
    assert peak.flops == pytest.approx(flops)
    assert peak.source == source


@pytest.mark.parametrize("kind", ["NVIDIA L40S", "TPU7x", "NVIDIA GeForce RTX 4090", "cpu"])
def test_unknown_device_kinds_get_no_peak_rather_than_a_neighbours(kind):
    """A name fragment is a whole word: an L40S is not an L4, a v5p is not a v5 lite."""
    assert peaks.known_peak(kind, "bfloat16") is None


def test_compare_takes_an_accelerators_peak_per_device():
    run = SimpleNamespace(devices=4, result=SimpleNamespace(target="jax-tpu", device_kind="TPU v5 lite"))
    peak, devices = _peak_for(run, "bfloat16", {})   # type: ignore[arg-type]
    assert (peak.flops, devices, peak.source) == (197e12, 4, "datasheet tpu v5 lite bfloat16")
    run = SimpleNamespace(devices=1, result=SimpleNamespace(target="inductor-cuda", device_kind="NVIDIA B300"))
    peak, _ = _peak_for(run, "bfloat16", {})          # type: ignore[arg-type]
    assert peak.flops != peak.flops and peak.source == "unknown accelerator 'NVIDIA B300'"   # NaN: MFU unknown


def test_xla_tpu_is_found_by_its_device_files_or_tpu_name(tmp_path, monkeypatch):
    from xbridge.backends import xlaspmd

    backend = xlaspmd.XlaBackend()
    accel = tmp_path / "accel0"
    monkeypatch.setattr(xlaspmd, "TPU_DEVICE_FILES", (str(accel), str(tmp_path / "vfio")))
    monkeypatch.delenv("TPU_NAME", raising=False)
    assert backend.device_reason("tpu") == ("no TPU here (no /dev/accel* or /dev/vfio device, TPU_NAME unset): "
                                            "xla-tpu runs on a TPU VM; it can compile for one here: xbridge compile "
                                            "PROG --backend xla-tpu --topology v5e-8")
    accel.touch()                                   # a TPU VM's chip
    assert backend.device_reason("tpu") is None
    accel.unlink()
    monkeypatch.setenv("TPU_NAME", "my-v5e-8")      # a launcher naming the TPU
    assert backend.device_reason("tpu") is None
    assert backend.device_reason("cpu") is None


def test_jax_tpu_reasons_with_and_without_a_chip_and_libtpu(monkeypatch):
    """No TPU chip on the PCI bus: said without loading libtpu, with the compile route (libtpu installed) or how to
    get it; a chip but no libtpu: the install hint; a chip and libtpu but a runtime that fails: JAX's own refusal,
    first line, not a crash."""
    from xbridge import plugin
    from xbridge.backends import jaxjit

    real = importlib.util.find_spec
    reason = jaxjit.JaxBackend().device_reason("tpu")
    assert reason == ("no TPU chip on this machine's PCI bus; it can compile for one here: xbridge compile PROG "
                      "--backend jax-tpu --topology v5e-8")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    assert jaxjit.JaxBackend().device_reason("tpu") == (
        "no TPU chip on this machine's PCI bus; to compile for one here without running: pip install "
        "'xbridge[tpu-compile]' (make setup installs it)")
    monkeypatch.setattr(plugin, "tpu_chips_on_this_machine", lambda: 4)      # a TPU VM's PCI bus (as backends see it)
    assert jaxjit.JaxBackend().device_reason("tpu") == ("jax has no TPU runtime here (none of libtpu is installed; "
                                                        "pip install 'jax[tpu]' on a TPU VM)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else real(name, *a))
    reason = jaxjit.JaxBackend().device_reason("tpu")
    assert reason is not None and reason.startswith("jax found no tpu device: "), reason


@pytest.mark.xla_env
def test_torch_xla_on_tpu_keeps_a_persistent_cache_and_on_cpu_none(tmp_path, monkeypatch):
    """start_runtime's TPU branch: torch_xla's persistent cache under xbridge's cache folder (PJRT's CPU client
    cannot reload executables, so the CPU branch opens none); the folder is one `xbridge cache` knows."""
    from xbridge import cache
    from xbridge.backends.xlaspmd import executable

    monkeypatch.setenv("XBRIDGE_CACHE_DIR", str(tmp_path))
    calls: list[tuple] = []
    for device_type, expected in (("TPU", [("initialize_cache", str(tmp_path / "torch_xla-tpu"), False)]),
                                  ("CPU", [])):
        calls.clear()
        monkeypatch.setattr(executable, "_RUNTIME_READY", False)
        monkeypatch.setattr(executable.xr, "use_spmd", lambda: calls.append(("use_spmd",)))
        monkeypatch.setattr(executable.xr, "device_type", lambda device_type=device_type: device_type)
        monkeypatch.setattr(executable.xr, "initialize_cache",
                            lambda path, readonly: calls.append(("initialize_cache", path, readonly)))
        executable.start_runtime()
        assert calls == [("use_spmd",), *expected]
    entry = tmp_path / "torch_xla-tpu" / "5d1f00c4a9b2e8a1"      # an executable under its graph hash
    entry.parent.mkdir(exist_ok=True)
    entry.write_bytes(b"x" * 10)
    (entry.parent / "notes.txt").write_text("mine")                # not the framework's: listed apart
    listed = {info.name: info for info in cache.describe()}
    assert listed["torch_xla-tpu"].bytes == 10 and listed["torch_xla-tpu"].not_a_cache == ("notes.txt",)
    assert "TPU" in listed["torch_xla-tpu"].what


@pytest.mark.xla_env
@pytest.mark.parametrize("accelerator_type,flops", [("v4", 275e12), ("v5litepod", 197e12), ("v5p", 459e12),
                                                    ("v6e", 918e12)])
def test_xla_tpu_names_its_tpu_for_the_peak_table(monkeypatch, accelerator_type, flops):
    """xla-tpu's device kind comes from the TPU VM's accelerator type (torch_xla's get_tpu_type)."""
    from torch_xla._internal import tpu

    from xbridge.backends.xlaspmd import capabilities

    monkeypatch.setattr(capabilities.xr, "device_type", lambda: "TPU")
    monkeypatch.setattr(tpu, "get_tpu_type", lambda: accelerator_type)
    kind = capabilities.tpu_device_kind()
    assert kind == f"TPU {accelerator_type}"
    peak = peaks.known_peak(kind, "bfloat16")
    assert peak is not None and peak.flops == flops
    monkeypatch.setattr(capabilities.xr, "device_type", lambda: "CPU")
    assert capabilities.tpu_device_kind() is None
