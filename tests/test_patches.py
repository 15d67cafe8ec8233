"""xbridge's changes to the frameworks' private API (one ``patches`` module per stack: xbridge/torch/patches.py,
backends/{jaxjit,xlaspmd,inductor}/patches.py): importing any backend module changes nothing in torch, torch_xla,
torchax or jax; applying the patches changes what they say, twice is once, and undoing them puts everything back; a
version other than the pinned one is refused with one line naming the patch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import user_env
from xbridge.errors import RunError

# Runs in a fresh process: the frameworks imported, their attributes noted, then every module of every backend
# package imported, then each stack's patches applied (twice) and undone, and the scoped ones entered and left.
_CHECK = r'''
import importlib, json, pkgutil, types
from xbridge.contract import registry

# the stacks this environment has (.venv: jax and inductor; .venv-xla: xla and inductor)
STACKS = [s for s, b in (("jaxjit", "jax"), ("xlaspmd", "xla"), ("inductor", "inductor"))
          if registry.load(b).backend is not None and registry.load(b).backend.missing_package() is None]
import torch
import torch._dynamo.config, torch._functorch.config, torch._inductor.config
OWNERS = {"torch": torch, "torch.amp.GradScaler": torch.amp.GradScaler}
TABLES = {}
if "jaxjit" in STACKS:
    import torchax, jax
    from torchax import amp
    from torchax.ops import ops_registry
    env = torchax.default_env()
    OWNERS |= {"torchax": torchax, "jax": jax, "torchax.amp": amp}
    TABLES |= {"torchax.amp.autocast_policy": amp.autocast_policy,
               "ops_registry.all_aten_ops": ops_registry.all_aten_ops, "torchax.default_env()._ops": env._ops}
if "xlaspmd" in STACKS:
    import torch_xla, torch_xla.experimental.scan
    from torch_xla._internal import tpu
    OWNERS |= {"torch_xla": torch_xla, "torch_xla.experimental.scan": torch_xla.experimental.scan,
               "torch_xla._XLAC": torch_xla._XLAC, "torch_xla._internal.tpu": tpu}
CONFIGS = {"torch._inductor.config": torch._inductor.config, "torch._functorch.config": torch._functorch.config,
           "torch._dynamo.config": torch._dynamo.config}


def snapshot():
    return ({name: dict(vars(owner)) for name, owner in OWNERS.items()},
            {name: dict(table) for name, table in TABLES.items()},
            {name: config.get_config_copy() for name, config in CONFIGS.items()})


def changes(before):
    attrs, tables, configs = before
    found = []
    for name, owner in OWNERS.items():
        now = vars(owner)
        found += [f"{name}.{k}" for k, v in attrs[name].items() if now.get(k, attrs) is not v]
        found += [f"{name}.{k} (added)" for k, v in now.items()
                  if k not in attrs[name] and not isinstance(v, types.ModuleType)]
    for name, table in TABLES.items():
        found += [f"{name}[{k}]" for k in set(table) | set(tables[name]) if table.get(k) is not tables[name].get(k)]
    for name, config in CONFIGS.items():
        now = config.get_config_copy()
        found += [f"{name}.{k}" for k in now if now[k] != configs[name].get(k)]
    return sorted(found)


before = snapshot()
imported = []
import xbridge.backends, xbridge.torch
for package in (xbridge.backends, xbridge.torch):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        stack = info.name.split(".")[2] if info.name.startswith("xbridge.backends.") else None
        if stack in ("jaxjit", "xlaspmd") and stack not in STACKS:
            continue        # that stack's framework is in the other environment
        importlib.import_module(info.name)
        imported.append(info.name)
out = {"stacks": STACKS, "imported": imported, "import_changes": changes(before)}

from xbridge.backends.inductor import patches as inductor
from xbridge.torch import patches as shared
from xbridge.torch.portable_rng import factories
if "jaxjit" in STACKS:
    from xbridge.backends.jaxjit import patches as jaxjit
if "xlaspmd" in STACKS:
    from xbridge.backends.xlaspmd import patches as xlaspmd

before = snapshot()


def apply():
    if "jaxjit" in STACKS:
        jaxjit.apply()
    if "xlaspmd" in STACKS:
        xlaspmd.apply(True)
    inductor.apply()
    if torch._inductor.config.cpp.vec_isa_ok is None:
        inductor.skip_vec_isa_probe()
    inductor.debug_trace(__import__("pathlib").Path("dump"))


apply()
out["applied"] = changes(before)
once = snapshot()
apply()
out["twice"] = changes(once)
for stack in STACKS:
    globals()[stack].undo()
out["undone"] = changes(before)

inside = {}
with factories():
    inside["factories"] = changes(before)
if "xlaspmd" in STACKS:
    built = []
    with xlaspmd.recording_scans(built):
        inside["recording_scans"] = changes(before)
    with xlaspmd.tpu_generation(6):
        inside["tpu_generation"] = changes(before) + [tpu.version()]
if "jaxjit" in STACKS:
    with jaxjit.routed_attention(lambda *a, **k: None):
        inside["routed_attention"] = changes(before)
out["inside"] = inside
out["left"] = changes(before)
print("RESULT" + json.dumps(out))
'''


# Each environment checks the stacks it has (scripts/test.sh runs this file in .venv and in .venv-xla): the jax and
# inductor stacks in .venv, the xla and inductor stacks in .venv-xla.
pytestmark = pytest.mark.both_envs


@pytest.fixture(scope="module")
def checked() -> dict:
    env = {**user_env(), "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def test_importing_every_backend_module_patches_nothing(checked):
    stacks = set(checked["stacks"])
    assert stacks in ({"jaxjit", "inductor"}, {"xlaspmd", "inductor"}), stacks      # .venv or .venv-xla
    expected = {"xbridge.backends.inductor.rank_engine", "xbridge.torch.portable_rng"}
    expected |= {"xbridge.backends.jaxjit.lowering"} if "jaxjit" in stacks else set()
    expected |= {"xbridge.backends.xlaspmd.layer_scan_loops"} if "xlaspmd" in stacks else set()
    assert expected <= set(checked["imported"])
    assert checked["import_changes"] == []


def test_the_patches_apply_once_and_undo_restores(checked):
    applied = set(checked["applied"])
    assert {"torch._inductor.config.trace.enabled", "torch._dynamo.config.debug_dir_root"} <= applied, applied
    if "jaxjit" in checked["stacks"]:
        assert "torchax.amp.execute_policy" in applied, applied
        assert any(entry.startswith("torchax.default_env()._ops[aten._grouped_mm") for entry in applied), applied
        assert any(entry.startswith("torchax.amp.autocast_policy[") for entry in applied), applied
    if "xlaspmd" in checked["stacks"]:
        assert "torch_xla.experimental.scan._scan_impl_pytree" in applied, applied
    assert checked["twice"] == []            # applying again changes nothing
    assert checked["undone"] == []


def test_the_scoped_patches_are_put_back(checked):
    inside = checked["inside"]
    assert inside["factories"] == ["torch.normal", "torch.rand", "torch.rand_like", "torch.randint",
                                   "torch.randint_like", "torch.randn", "torch.randn_like", "torch.randperm"]
    if "xlaspmd" in checked["stacks"]:
        assert inside["recording_scans"] == ["torch_xla._XLAC._xla_user_computation"]
        assert inside["tpu_generation"] == ["torch_xla._internal.tpu.version", 6]
    if "jaxjit" in checked["stacks"]:
        assert len(inside["routed_attention"]) == 3 and all("._ops[" in e for e in inside["routed_attention"])
    assert checked["left"] == []


def test_a_version_other_than_the_pin_is_one_line_naming_the_patch(monkeypatch):
    from xbridge.backends.inductor import patches as inductor
    from xbridge.backends.jaxjit import patches as jaxjit
    from xbridge.backends.xlaspmd import patches as xlaspmd
    from xbridge.torch import patches as shared

    monkeypatch.setattr(shared, "installed_version", lambda dist: "9.9.9")
    for apply, patch in ((jaxjit.apply, jaxjit.AUTOCAST), (lambda: xlaspmd.apply(True), shared.RANDOM_FACTORIES),
                         (inductor.apply, shared.RANDOM_FACTORIES)):
        with pytest.raises(RunError) as caught:
            apply()
        message = str(caught.value)
        assert "\n" not in message and caught.value.exit_code == 1
        assert message == (f"xbridge's patch of {patch.name} is written for {patch.dist} {patch.supported} "
                           f"(pyproject.toml), but {patch.dist} 9.9.9 is installed here; install a {patch.dist} in "
                           "that range")
    with pytest.raises(RunError, match="patch of torch_xla.experimental.scan._scan_impl_pytree .* torch_xla ==2.9.0 "):
        monkeypatch.setattr(shared, "installed_version", lambda dist: "2.9.0" if dist == "torch" else "2.8.1")
        xlaspmd.apply(True)
    monkeypatch.setattr(shared, "installed_version", lambda dist: None)
    with pytest.raises(RunError, match=r"but torch is not installed here; install a torch in that range$"):
        inductor.apply()
    # a local build label is the same release (CUDA wheels: 2.9.0+cu128, 2.14.1+cu130); both ends of the range pass
    for version in ("2.9.0+cu128", "2.14.1+cu130", "2.15.0"):
        monkeypatch.setattr(shared, "installed_version", lambda dist, v=version: v)
        shared.check(shared.RANDOM_FACTORIES)
    monkeypatch.setattr(shared, "installed_version", lambda dist: "2.8.0")
    with pytest.raises(RunError, match=r"written for torch >=2.9,<2.16 \(pyproject.toml\), but torch 2.8.0 is installed"):
        shared.check(shared.RANDOM_FACTORIES)
    monkeypatch.setattr(shared, "installed_version", lambda dist: "0.0.14.dev20261026")
    shared.check(jaxjit.AUTOCAST)
