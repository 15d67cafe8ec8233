"""Backend discovery, target parsing, availability reasons, and third-party plugins."""

from __future__ import annotations

import importlib.metadata

import pytest

from xbridge.contract import Backend, Target, registry
from xbridge.errors import BackendUnavailable, TargetError


class ThirdPartyBackend(Backend):
    name = "toy"
    devices = ("cpu",)
    requires = ("numpy",)


class NoDeviceBackend(Backend):
    name = "nodev"
    devices = ("npu",)
    requires = ("a_package_that_is_not_installed_anywhere",)


@pytest.fixture
def plugins(monkeypatch):
    """Extra entry points next to the installed ones, as a third-party distribution would add them."""
    def install(remove: tuple[str, ...] = (), **values: str) -> None:
        eps = {k: v for k, v in registry.entry_points().items() if k not in remove}
        for name, value in values.items():
            eps[name] = importlib.metadata.EntryPoint(name=name, value=value, group=registry.GROUP)
        monkeypatch.setattr(registry, "entry_points", lambda: eps)
        registry.load.cache_clear()

    yield install
    registry.load.cache_clear()


def test_parse_targets():
    assert registry.parse_target("eager-cpu") == Target("eager", "cpu")
    assert registry.parse_target("JAX-GPU") == Target("jax", "cuda")
    assert registry.parse_target("inductor-gpu") == Target("inductor", "cuda")
    assert registry.parse_target("eager") == "eager"
    assert str(Target("jax", "tpu")) == "jax-tpu"


@pytest.mark.parametrize("text", ["foo-cpu", "eager-tpu", "jax", "cpu", "eager-"])
def test_unknown_target_lists_the_known_ones(text):
    if text == "jax":
        assert registry.parse_target(text) == "jax"   # a bare backend name is valid
        return
    with pytest.raises(TargetError) as info:
        registry.parse_target(text)
    message = str(info.value)
    assert f"unknown target {text!r}" in message
    for known in ("eager-cpu", "inductor-cuda", "xla-tpu", "jax-tpu"):
        assert known in message


def test_eager_is_registered_and_resolves():
    assert "eager" in registry.entry_points()
    target, backend = registry.resolve("eager-cpu")
    assert target == Target("eager", "cpu") and backend.name == "eager"
    target, _ = registry.resolve("eager")
    assert target.backend == "eager" and target.device in ("cpu", "cuda")


def test_eager_cuda_reason_matches_the_machine():
    import torch

    _, backend = registry.resolve("eager-cpu")
    reason = backend.unavailable_reason("cuda")
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert reason == "torch sees no CUDA device (torch.cuda.is_available() is False)"
        with pytest.raises(BackendUnavailable, match="target eager-cuda is unavailable: torch sees no CUDA"):
            registry.resolve("eager-gpu")


def test_targets_come_from_the_entry_points_alone(plugins):
    plugins(remove=("jax",))  # as on a machine where the jax plugin is not registered
    with pytest.raises(TargetError) as info:
        registry.resolve("jax-tpu")
    assert "unknown target 'jax-tpu'; known targets: eager-cpu, eager-cuda, inductor-cpu" in str(info.value)
    assert not any(row["target"].startswith("jax") for row in registry.describe())
    assert "--sharding-mode" not in {option.flag for option in registry.all_options().values()}


def test_broken_plugin_is_reported_not_raised(plugins):
    plugins(broken="xbridge_no_such_module_anywhere:Backend", toy=f"{__name__}:ThirdPartyBackend",
            nodev=f"{__name__}:NoDeviceBackend")
    rows = {row["target"]: row for row in registry.describe()}
    assert rows["toy-cpu"]["available"] and rows["toy-cpu"]["devices"] == 1
    assert not rows["nodev-npu"]["available"]
    assert "package 'a_package_that_is_not_installed_anywhere' is not installed" in rows["nodev-npu"]["reason"]
    assert rows["eager-cpu"]["available"]
    with pytest.raises(BackendUnavailable, match="backend 'broken' failed to load .*ModuleNotFoundError"):
        registry.resolve("broken")
    target, backend = registry.resolve("toy-cpu")
    assert isinstance(backend, ThirdPartyBackend) and target == Target("toy", "cpu")
    with pytest.raises(BackendUnavailable, match="backend 'nodev' has no usable device here"):
        registry.resolve("nodev")


def test_jax_is_unavailable_where_its_torchax_cannot_import_on_the_torch_there(monkeypatch):
    """torchax 0.0.13 on torch >= 2.13 fails at import: backends says so from the versions, before any run."""
    from xbridge.torch import patches

    jax_backend = registry.load("jax").backend
    versions = {"torch": "2.14.1+cu130", "torchax": "0.0.13"}
    monkeypatch.setattr(patches, "installed_version", lambda dist: versions.get(dist))
    assert jax_backend.unavailable_reason("cpu") == (
        "torchax 0.0.13 does not import on torch 2.14.1+cu130 (its operator table names overloads torch 2.13 removed); "
        "install torchax==0.0.14.dev20261026 (pip install 'xbridge[jax]')")
    for torch, torchax in (("2.9.0+cu128", "0.0.13"), ("2.14.1", "0.0.14.dev20261026")):
        versions = {"torch": torch, "torchax": torchax}
        assert jax_backend.unavailable_reason("cpu") is None, (torch, torchax)
