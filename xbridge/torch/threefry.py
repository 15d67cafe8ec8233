"""Threefry-2x32 (20 rounds) on int32 tensors, and the floats portable randomness derives from its words
(xbridge/torch/portable_rng.py says how each draw is keyed, counted and shaped)."""

from __future__ import annotations

import torch

from xbridge.errors import ProgramError

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _i32(value: int) -> int:
    """A Python int as the signed 32-bit value with the same low 32 bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


# Devices whose int32 ``>>`` shifts a negative value arithmetically (torch's own CPU and CUDA kernels, and what
# Inductor generates for them: C++ and Triton): there a logical shift is the arithmetic one with the sign's copies
# masked off, two operations instead of six (fewer for Inductor to lower and compile).
_ARITHMETIC_SHIFTS = ("cpu", "cuda")


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 words. Elsewhere (torch_xla 2.9 shifts a negative value as a division rounding
    toward zero: -5 >> 13 is 0 there, -1 in torch) only non-negative values are shifted and the sign bit is put
    back where the shift takes it. Both forms give the same bits."""
    if x.device.type in _ARITHMETIC_SHIFTS:
        return (x >> bits) & ((1 << (32 - bits)) - 1)
    return ((x & 0x7FFFFFFF) >> bits) | ((x < 0).to(torch.int32) << (31 - bits))


def _rotl(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x << bits) | _shr(x, 32 - bits)


def _stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, as a view: a graph compiler stores it in a buffer of its own here. Inductor (torch 2.14)
    inlines an elementwise value into each of its users while it holds fewer than 50 distinct operations, and
    evaluates the inlined expression once per use: a word is read two or three times a round, so lowering and code
    generation grew exponentially with the rounds inlined (measured: one block of four rounds 11 s, two blocks 45 s
    to over 100 s). Inductor stores the input of an as_strided (lowering.as_strided realizes it). Storing every
    second round (with the two-operation shift) took a one-layer nn.TransformerEncoder's inductor-cpu run under
    --rng portable from 68 s to 27 s (--rng native: 22 s; bench/portable_compile.py)."""
    return x.as_strided(x.shape, x.stride()) if torch.compiler.is_compiling() else x


def threefry2x32(key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32, 20 rounds: two int32 words of output per pair of int32 counter words, for a 2-word key. Under a
    graph compiler the two words are stored after every second round (:func:`_stored`)."""
    ks = (_i32(key[0]), _i32(key[1]), _i32(key[0] ^ key[1] ^ _PARITY))
    x0, x1 = c0 + ks[0], c1 + ks[1]
    for block in range(5):
        for i, bits in enumerate(_ROTATIONS[block % 2]):
            x0 = x0 + x1
            x1 = _rotl(x1, bits) ^ x0
            if i % 2:
                x0, x1 = _stored(x0), _stored(x1)
        x0 = x0 + ks[(block + 1) % 3]
        x1 = x1 + _i32(ks[(block + 2) % 3] + block + 1)
    return x0, x1


def _uniform(bits: torch.Tensor, digits: int = 24) -> torch.Tensor:
    """float32 in [0, 1) from the top ``digits`` bits (exact in float32, and in a float of ``digits`` significant
    bits: every backend compares the same numbers, and a cast to float16/bfloat16 never rounds up to 1)."""
    return _shr(bits, 32 - digits).to(torch.float32) * (1.0 / (1 << digits))


def _open_uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1), for the draws that take a logarithm or a tangent: (k + 1/2) / 2^23 from the top 23 bits
    (k + 1/2 is exact in float32's 24 significant bits), so 2^-24 <= u <= 1 - 2^-24."""
    return (_shr(bits, 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


_DIGITS = {torch.float16: 11, torch.bfloat16: 8}       # significant bits below float32's 24
_INT32 = (-(1 << 31), 1 << 31)                          # JAX runs without 64-bit integers: int64 is int32 there


def _refuse(what: str, why: str = "") -> ProgramError:
    return ProgramError(f"{what} has no portable form (--rng portable){why}: draw with a portable sampler "
                        "(docs/parity.md, Randomness), or run with --rng native")
