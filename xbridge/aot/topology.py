"""``--topology``: the TPU slice names people use, mapped to what JAX's compile-only TPU client takes.

Two forms are accepted:

- the accelerator types of Google Cloud (``v5e-8``, ``v6e-16``, ``v5p-128``, ``v4-8``; ``v5litepod-8`` too): v5e
  and v6e names count chips; v4 and v5p names count TensorCores, two a chip, so ``v5p-128`` is 64 chips;
- JAX's own ``GENERATION:SHAPE`` (``v5e:2x4``, ``v5p:4x4x4``; ``v5:`` is v5p), passed through.

The mapping (topology shape, ``chip_config_name``, ``chips_per_host_bounds``, ``wrap``) is MaxText's table of
system characteristics (AI-Hypercomputer/maxtext, ``accelerator_to_spec_map.py``), the same arguments its
``train_compile.py`` hands ``jax.experimental.topologies.get_topology_desc``. v4 and v5p chips are compiled as
megacores (one JAX device a chip, as a TPU VM shows them), so every device in a report is a chip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from .chips import CHIPS, Chip

# chips -> 2-d shape of a v5e or v6e slice (MaxText's table)
_FLAT = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_FLAT_WRAP = {128: (False, True, False), 256: (True, True, False)}
# chips -> 3-d shape of a v4 or v5p slice (MaxText's table, the regular ones)
_CUBE = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 192: "4x4x12",
         256: "4x8x8", 384: "4x8x12", 512: "8x8x8", 768: "8x8x12", 1024: "8x8x16", 2048: "8x16x16",
         4096: "16x16x16"}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5": "v5p", "v6": "v6e"}
_JAX_NAME = {"v4": "v4", "v5e": "v5e", "v5p": "v5", "v6e": "v6e"}
_MEGACORE = {"v4", "v5p"}


@dataclass(frozen=True)
class Topology:
    """A TPU slice to compile for: JAX's name and arguments, the chip, and how many there are."""
    asked: str                   # as the user wrote it
    jax_name: str                # e.g. "v5e:2x4"
    chip: Chip
    chips: int
    chip_config_name: str
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]

    @property
    def hosts(self) -> int:
        return max(1, self.chips // math.prod(self.chips_per_host_bounds))

    def jax_kwargs(self) -> dict[str, object]:
        """The keyword arguments of ``jax.experimental.topologies.get_topology_desc``."""
        return {"topology_name": self.jax_name, "platform": "tpu", "chip_config_name": self.chip_config_name,
                "chips_per_host_bounds": self.chips_per_host_bounds, "wrap": self.wrap}

    def to_json(self) -> dict[str, object]:
        return {"asked": self.asked, "jax_topology": self.jax_name, "chips": self.chips, "hosts": self.hosts,
                "chip_config_name": self.chip_config_name, "chip": self.chip.to_json()}


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(f"--topology {text!r}: {why}; use a Cloud TPU name (v5e-8, v6e-16, v5p-128, v4-8) or JAX's "
                       "GENERATION:SHAPE (v5e:2x4, v5p:4x4x4)")


def parse_topology(text: str) -> Topology:
    """``v5e-8`` / ``v5p-128`` / ``v5e:2x4`` -> :class:`Topology`; anything else is one ConfigError line."""
    name = text.strip().lower()
    if m := re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name):
        gen, count = _ALIASES.get(m[1], m[1]), int(m[2])
        if gen not in CHIPS:
            raise _bad(text, f"unknown TPU generation {m[1]!r} (known: {', '.join(CHIPS)})")
        if gen in _MEGACORE:
            if count % 2 or count // 2 not in _CUBE:
                raise _bad(text, f"{gen} names count TensorCores, two a chip; {count} is not a slice size xbridge "
                                 f"knows ({', '.join(f'{gen}-{2 * c}' for c in list(_CUBE)[:6])}, ...)")
            chips, shape = count // 2, _CUBE[count // 2]
        else:
            if count not in _FLAT:
                raise _bad(text, f"{gen} names count chips; {count} is not a slice size "
                                 f"({', '.join(f'{gen}-{c}' for c in _FLAT)})")
            chips, shape = count, _FLAT[count]
    elif m := re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", name):
        gen, shape = _ALIASES.get(m[1], m[1]), m[2]
        if gen not in CHIPS:
            raise _bad(text, f"unknown TPU generation {m[1]!r} (known: {', '.join(CHIPS)})")
        dims = [int(d) for d in shape.split("x")]
        if len(dims) != (3 if gen in _MEGACORE else 2) or 0 in dims:
            raise _bad(text, f"a {gen} slice's shape has {3 if gen in _MEGACORE else 2} dimensions, got {shape!r}")
        chips = math.prod(dims)
    else:
        raise _bad(text, "not a TPU slice name")
    single = chips == 1
    if gen in _MEGACORE:
        wrap = (True, True, True) if all(int(d) >= 4 for d in shape.split("x")) else (False, False, False)
    else:
        wrap = _FLAT_WRAP.get(chips, (False, False, False))
    return Topology(text, f"{_JAX_NAME[gen]}:{shape}", CHIPS[gen], chips,
                    "megacore" if gen in _MEGACORE else "default", (1, 1, 1) if single else (2, 2, 1), wrap)
