"""JSON form of the IR: every non-callable field round-trips, and the canonical JSON gives a stable hash.

Each IR dataclass registers itself with :func:`register`; its JSON form is ``{"kind": ClassName, **fields}``.
Constructors normalise lists back to tuples, so ``from_config(to_config(x)) == x``. A program's data source is
written by :func:`describe` (the registered sources of xbridge/data as their fields, a user's by its own
``describe()`` or its dataclass fields, else opaque).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ..errors import ConfigError
from .source_checks import source_name

_KINDS: dict[str, type] = {}


def register(cls: type) -> type:
    _KINDS[cls.__name__] = cls
    return cls


def to_config(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__name__ not in _KINDS:
            raise ConfigError(f"{type(obj).__name__} is not a serialisable xbridge IR type")
        out: dict[str, Any] = {"kind": type(obj).__name__}
        for f in dataclasses.fields(obj):
            if f.metadata.get("callable"):
                continue
            value = getattr(obj, f.name)
            if f.metadata.get("data") and value is not None:
                out[f.name] = describe(value)
                continue
            out[f.name] = to_config(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_config(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_config(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ConfigError(f"value {obj!r} of type {type(obj).__name__} cannot be written to JSON")


def from_config(config: Any, **callables: Any) -> Any:
    """Rebuild IR objects from :func:`to_config` output. ``callables`` fill the top object's callable fields."""
    if isinstance(config, dict) and "kind" in config:
        kind = config["kind"]
        cls = _KINDS.get(kind)
        if kind in ("described", "opaque"):
            raise ConfigError(f"data {config.get('class')!r} is described in the config, not rebuilt from it; pass "
                              "the source itself")
        if cls is None:
            raise ConfigError(f"unknown IR kind {kind!r} in config (known: {', '.join(sorted(_KINDS))})")
        fields = {k: from_config(v) for k, v in config.items() if k != "kind"}
        return cls(**fields, **callables)
    if isinstance(config, list):
        return [from_config(v) for v in config]
    if isinstance(config, dict):
        return {k: from_config(v) for k, v in config.items()}
    return config


def canonical_json(obj: Any, leave_out: tuple[str, ...] = ()) -> str:
    """Key-sorted, compact JSON of ``obj``'s config; ``leave_out`` drops fields (``"mesh"``, or a nested one as
    ``"step.remat"``)."""
    data = to_config(obj)
    for field in leave_out:
        *parents, last = field.split(".")
        node = data
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_hash(obj: Any, leave_out: tuple[str, ...] = ()) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON: stable across processes and machines."""
    return hashlib.sha256(canonical_json(obj, leave_out).encode()).hexdigest()[:16]


def _json_ready(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def describe(source: Any) -> dict[str, Any]:
    """The JSON form of a source in the program config: a registered IR type's fields; else the source's own
    ``describe()``; else a dataclass's fields; else only its class and batch size (``reproducible: false``)."""
    if type(source).__name__ in _KINDS and dataclasses.is_dataclass(source):
        return to_config(source)
    own = getattr(source, "describe", None)
    if callable(own):
        info = own()
        if not isinstance(info, dict):
            raise ConfigError(f"data {source_name(source)}.describe() must return a JSON-ready dict, got "
                              f"{type(info).__name__}")
        for key, value in info.items():
            if not isinstance(key, str) or not _json_ready(value):
                raise ConfigError(f"data {source_name(source)}.describe(): field {key!r} is not JSON (type "
                                  f"{type(value).__name__}): give numbers, strings, lists or dicts of them, an "
                                  "array as .tolist()")
        return {"kind": "described", "class": source_name(source), "batch_size": source.batch_size, **info}
    if dataclasses.is_dataclass(source):
        fields = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)}
        if _json_ready(fields):
            return {"kind": "described", "class": source_name(source), "fields": fields}
    return {"kind": "opaque", "class": source_name(source), "batch_size": source.batch_size, "reproducible": False}
