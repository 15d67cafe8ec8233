"""What xbridge changes in torch's private API for every torch-based stack, and the version guard each stack's
``patches`` module uses (backends/jaxjit/patches.py, backends/xlaspmd/patches.py, backends/inductor/patches.py).

The rule: every change xbridge makes to a framework's private API lives in one ``patches`` module per stack, is
applied from ``Backend.lower()`` or ``Backend.configure()`` (never when a module is imported; tests/test_patches.py
imports every backend module and checks that nothing changed), is undone where the framework allows, and is checked
against the versions it is written and tested for first (pyproject.toml's ranges; the suite runs on both ends): with
a version outside them installed it is refused with one line naming the patch, the supported versions and the
installed one (:class:`~xbridge.errors.RunError`, exit code 1).

The patch held here (torch 2.9 to 2.15):

- ``torch.rand``, ``torch.randn``, ``torch.randint`` replaced by forwarders to the portable generator while a loss
  runs under ``--rng portable`` (:func:`replaced_factories`, used by xbridge/torch/portable_rng.py). The factories
  that take no tensor are not in ``torch.overrides.get_overridable_functions()``, so Dynamo (inductor, xla's openxla
  mode) does not route them to a TorchFunctionMode as eager torch does; Dynamo classifies ``torch.<name>`` with a map
  it builds from those names (``torch._dynamo.trace_rules.get_torch_obj_rule_map``, private), built here first with
  the originals (torch.distributed's init_process_group clears it), so that the forwarders are traced as Python
  rather than put in the graph as an opaque call. Undone when the loss call returns (the functions that were there
  put back).

This module imports no framework (torch is imported inside the functions that need it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from xbridge.errors import RunError

# The versions each stack's patches are written for (pyproject.toml's ranges): the suite runs torch 2.9.0 (with
# torch_xla 2.9.0, .venv-xla) and 2.14.1 (with torchax 0.0.14.dev20261026, .venv); torch 2.15.0 ran the GPT, CNN and
# MoE parity programs (issue 56's account). torchax 0.0.13 is the release these patches were first written for.
TORCH = ">=2.9,<2.16"
TORCH_XLA = "==2.9.0"
TORCHAX = ">=0.0.13,<=0.0.14.dev20261026"


@dataclass(frozen=True)
class Patch:
    """One change to a framework's private API: what it changes (named in the guard's error) and the versions of the
    distribution it is written for (a PEP 440 specifier)."""

    name: str
    dist: str
    supported: str


RANDOM_FACTORIES = Patch("torch.rand/randn/randint/randperm/normal and the _like factories, and "
                         "torch.nn.functional's dropout and scaled_dot_product_attention, forwarded to the portable "
                         "generator (Dynamo's torch object map built first)", "torch", TORCH)
PATCHES = (RANDOM_FACTORIES,)


@functools.cache
def installed_version(dist: str) -> str | None:
    """The installed version of ``dist`` (None when it is not installed); looked up once per process."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def supports(patch: Patch, installed: str) -> bool:
    """Whether ``installed`` (a local build label, ``2.14.1+cu130``, is its release) is in the patch's versions."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(patch.supported).contains(Version(installed.split("+", 1)[0]), prereleases=True)
    except InvalidVersion:
        return False


def check(patch: Patch) -> None:
    """Refuse ``patch`` (one line) unless the installed version of its distribution is one it is written for."""
    installed = installed_version(patch.dist)
    if installed is None or not supports(patch, installed):
        found = f"{patch.dist} is not installed" if installed is None else f"{patch.dist} {installed} is installed"
        raise RunError(f"xbridge's patch of {patch.name} is written for {patch.dist} {patch.supported} "
                       f"(pyproject.toml), but {found} here; install a {patch.dist} in that range")


def check_all(patches: tuple[Patch, ...] = PATCHES) -> None:
    for patch in patches:
        check(patch)


_MISSING: Any = object()


class PatchSet:
    """One stack's process-wide patches: each attribute or entry changed through :meth:`set`, :meth:`set_item` or
    :meth:`record_item` keeps what was there first, which :meth:`undo` puts back (latest first)."""

    def __init__(self, *patches: Patch) -> None:
        self.patches = patches
        self.applied = False
        self._saved: dict[tuple[int, Any], tuple[Any, Any, Any, bool]] = {}

    def check(self) -> None:
        check_all(self.patches)

    def apply(self, install: Callable[[PatchSet], None]) -> None:
        """Check every pin, then ``install(self)`` once per process (until :meth:`undo`)."""
        self.check()
        if not self.applied:
            install(self)
            self.applied = True

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._remember(owner, name, getattr(owner, name, _MISSING), item=False)
        setattr(owner, name, value)

    def record_item(self, mapping: Mapping[Any, Any], key: Any) -> None:
        """Note ``mapping[key]`` before a framework function changes it (for :meth:`undo`)."""
        self._remember(mapping, key, mapping.get(key, _MISSING), item=True)

    def set_item(self, mapping: MutableMapping[Any, Any], key: Any, value: Any) -> None:
        self.record_item(mapping, key)
        mapping[key] = value

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this set changed it (what it is, when unchanged)."""
        saved = self._saved.get((id(owner), name))
        return getattr(owner, name) if saved is None else saved[2]

    def undo(self) -> None:
        for owner, key, value, item in reversed(list(self._saved.values())):
            _put(owner, key, value, item)
        self._saved.clear()
        self.applied = False

    def _remember(self, owner: Any, key: Any, value: Any, item: bool) -> None:
        self._saved.setdefault((id(owner), key), (owner, key, value, item))


def _put(owner: Any, key: Any, value: Any, item: bool) -> None:
    if item:
        if value is _MISSING:
            owner.pop(key, None)
        else:
            owner[key] = value
    elif value is _MISSING:
        if hasattr(owner, key):
            delattr(owner, key)
    else:
        setattr(owner, key, value)


@contextlib.contextmanager
def replaced(owner: Any, values: Mapping[Any, Any], *, items: bool = False) -> Iterator[None]:
    """``owner``'s attributes (or, with ``items``, its entries) set to ``values`` for the block; what was there is
    put back after it, however it ends."""
    before = {key: (owner.get(key, _MISSING) if items else getattr(owner, key, _MISSING)) for key in values}
    for key, value in values.items():
        if items:
            owner[key] = value
        else:
            setattr(owner, key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            _put(owner, key, value, items)


@contextlib.contextmanager
def replaced_factories(forwarders: Mapping[str, Callable[..., Any]],
                       functional: Mapping[str, Callable[..., Any]] | None = None) -> Iterator[None]:
    """``torch.<name>`` is ``forwarders[name]``, and ``torch.nn.functional.<name>`` ``functional[name]``, for the
    block (:data:`RANDOM_FACTORIES`)."""
    check(RANDOM_FACTORIES)
    import torch
    import torch.nn.functional as F
    from torch._dynamo.trace_rules import get_torch_obj_rule_map

    get_torch_obj_rule_map()
    with replaced(torch, forwarders), replaced(F, functional or {}):
        yield
