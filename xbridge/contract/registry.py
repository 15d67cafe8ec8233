"""Backend discovery through the entry-point group ``xbridge.backends`` and target parsing.

Discovery reads entry-point metadata only; a backend's module is imported when that backend is asked for, and a
failure to import becomes an "unavailable" reason instead of an exception.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

from ..errors import BackendUnavailable, TargetError
from .backend import Backend, BackendOption, Target

GROUP = "xbridge.backends"
DEVICE_ALIASES = {"gpu": "cuda"}


@functools.cache
def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


@dataclass(frozen=True)
class Loaded:
    backend: Backend | None
    error: str | None


@functools.cache
def load(name: str) -> Loaded:
    """Import and instantiate the plugin ``name``; never raises for a broken or missing plugin."""
    ep = entry_points().get(name)
    if ep is None:
        return Loaded(None, f"backend {name!r} is not installed: no plugin named {name!r} in entry-point group "
                            f"{GROUP!r}")
    try:
        cls = ep.load()
        backend = cls()
    except Exception as exc:  # a broken plugin must not break discovery of the others
        return Loaded(None, f"backend {name!r} failed to load ({ep.value}): {type(exc).__name__}: {exc}")
    if not isinstance(backend, Backend):
        return Loaded(None, f"backend {name!r} ({ep.value}) is not an xbridge.contract.Backend")
    return Loaded(backend, None)


def known_targets() -> list[str]:
    """Every ``BACKEND-DEVICE`` the installed plugins declare, the devices they refuse (``unsupported``) included,
    so that such a target gets its reason rather than "unknown"."""
    targets = []
    for name in entry_points():
        backend = load(name).backend
        if backend is not None:
            targets += [f"{name}-{device}" for device in dict.fromkeys((*backend.devices, *backend.unsupported))]
    return sorted(targets)


def backend_names() -> list[str]:
    return list(entry_points())


def all_options() -> dict[str, BackendOption]:
    """Every option any installed backend declares, by name (the CLI accepts exactly these flags)."""
    options: dict[str, BackendOption] = {}
    for name in entry_points():
        backend = load(name).backend
        for option in backend.options if backend is not None else ():
            options.setdefault(option.name, option)
    return options


def parse_target(text: str) -> Target | str:
    """``BACKEND-DEVICE`` -> Target; a bare backend name -> that name (the device is picked later)."""
    raw = text.strip().lower()
    if raw in backend_names():
        return raw
    backend, sep, device = raw.rpartition("-")
    device = DEVICE_ALIASES.get(device, device)
    broken = backend in backend_names() and load(backend).backend is None   # its devices are unknown: say why later
    if not sep or backend not in backend_names() or not (broken or f"{backend}-{device}" in known_targets()):
        raise TargetError(f"unknown target {text!r}; known targets: {', '.join(known_targets())} "
                          "(or a bare backend name: " + ", ".join(backend_names()) + ")")
    return Target(backend, device)


def resolve(text: str) -> tuple[Target, Backend]:
    """The target and its backend, or BackendUnavailable saying why it cannot run here."""
    parsed = parse_target(text)
    name = parsed if isinstance(parsed, str) else parsed.backend
    loaded = load(name)
    if loaded.backend is None:
        raise BackendUnavailable(f"target {text} is unavailable: {loaded.error}")
    backend = loaded.backend
    if isinstance(parsed, str):
        device = backend.default_device()
        if device is None:
            reasons = "; ".join(f"{d}: {backend.unavailable_reason(d)}" for d in backend.devices)
            raise BackendUnavailable(f"backend {name!r} has no usable device here ({reasons})")
        return Target(name, device), backend
    reason = backend.unavailable_reason(parsed.device)
    if reason is not None:
        raise BackendUnavailable(f"target {parsed} is unavailable: {reason}")
    return parsed, backend


def declared(text: str) -> Backend:
    """The backend ``BACKEND[-DEVICE]`` names, whether or not it can run in this interpreter (another environment may
    run it: xbridge/environments.py); BackendUnavailable when its plugin does not load."""
    parsed = parse_target(text)
    name = parsed if isinstance(parsed, str) else parsed.backend
    loaded = load(name)
    if loaded.backend is None:
        raise BackendUnavailable(f"target {text} is unavailable: {loaded.error}")
    return loaded.backend


def parse_declared(text: str) -> Target:
    """``BACKEND-DEVICE`` as a Target (``text`` is a canonical target another environment reported)."""
    parsed = parse_target(text)
    if isinstance(parsed, str):
        raise TargetError(f"target {text!r}: give BACKEND-DEVICE")
    return parsed


def describe() -> list[dict]:
    """One row per known target: availability (or why not), versions and device count. A plugin that failed to
    load has one row under its bare name, with the error."""
    rows = []
    for name in entry_points():
        loaded = load(name)
        if loaded.backend is None:
            rows.append({"target": name, "available": False, "reason": loaded.error, "versions": {}, "devices": 0})
            continue
        for target in known_targets():
            backend_name, _, device = target.rpartition("-")
            if backend_name != name:
                continue
            reason = loaded.backend.unavailable_reason(device)
            rows.append({"target": target, "available": reason is None, "reason": reason,
                         "versions": loaded.backend.versions() if reason is None else {},
                         "devices": loaded.backend.device_count(device) if reason is None else 0})
    return rows
