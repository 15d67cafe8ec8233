"""The reference's own noise in fp32, for parameters with no true gradient (docs/parity.md, "Parameters with no
true gradient").

Attention's key bias has a true gradient of zero (softmax ignores a constant added to every key), so its gradient
is nothing but fp32 rounding and Adam turns that into steps of up to lr, differently on every stack. Parity measures
how far the reference itself moves such a tensor: the eager reference runs again from initial weights one ulp apart
(:func:`ulp_weights`: every op then rounds differently, as on another stack; data, random draws and the loss are
unchanged), and the elements with no true gradient are found from step 0's fp32 gradient (:func:`quiet_elements`).
Only those elements are lent the measured noise (xbridge/parity/policy.py, ``param_deviation``).
"""

from __future__ import annotations

import re

import numpy as np

from ..ir.program import Program

# An element whose step-0 gradient is below this share of the loudest tensor's RMS gradient has no true gradient:
# what is left is fp32 rounding, ~1e-7 of the terms summed. Measured on tests/fixtures/no_true_grad.py: every key
# bias element <= 5.9e-9, every tensor's median >= 1.7e-2; the smallest real element 4.5e-6 (one of attn.v.weight's
# 1024, by chance: an element flagged so is harmless, its own noise is rounding-sized and lends nothing)
QUIET_GRADIENT = 1e-5

_KEY = re.compile(r"(^|\.)(k|key|k_proj|to_k|wk|k_lin|key_proj)\.bias$")
_FUSED = re.compile(r"(^|\.)(qkv|c_attn|query_key_value|wqkv|Wqkv|in_proj)\.bias$|(^|\.)in_proj_bias$")


def ulp_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every non-zero floating element one ulp up (zeros stay zero, integer buffers unchanged; a complex element's
    real and imaginary parts each)."""
    def up(array: np.ndarray) -> np.ndarray:
        return np.where(array != 0, np.nextafter(array, np.array(np.inf, array.dtype)), array)

    out = {}
    for name, array in weights.items():
        if np.issubdtype(array.dtype, np.floating):
            array = up(array)
        elif np.iscomplexobj(array):
            array = (up(array.real) + 1j * up(array.imag)).astype(array.dtype)
        out[name] = array
    return out


def quiet_elements(program: Program, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per parameter with any: the boolean mask of its elements whose step-0 gradient (fp32, eval mode, in this
    process) is below QUIET_GRADIENT x the loudest tensor's RMS gradient."""
    import torch

    from ..data.source import checked_batch
    from ..torch.train import batch_to_torch, build_model, compute_context, eval_mode, loss_parts, per_item, split_micro

    program = program.replace(precision="fp32")
    model = build_model(program, weights, torch.device("cpu"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    batch = batch_to_torch(checked_batch(program.data, 0, program.seed), torch.device("cpu"), program.precision)
    pieces = split_micro(batch, program.step.grad_accum)
    with eval_mode(model), compute_context(program, "cpu"):
        found = [loss_parts(program.loss(model, piece), program) for piece in pieces]
    values = torch.stack([v for v, _ in found])
    counts = [c for _, c in found if c is not None]
    loss = per_item(values.sum(), torch.stack(counts).sum()) if counts else values.mean()
    grads = {n: g.detach().to(torch.complex128 if g.is_complex() else torch.float64).numpy() for n, g in
             zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)) if g is not None}
    loudest = max((float(np.sqrt(np.mean(np.abs(g) ** 2))) for g in grads.values() if g.size), default=0.0)
    masks = {n: np.abs(g) < QUIET_GRADIENT * loudest for n, g in grads.items()}
    return {n: m for n, m in masks.items() if m.any()}


def kind(name: str, quiet: np.ndarray) -> str:
    """What the quiet elements are, where the name and the mask tell it: a key bias (its own, or the middle third of
    a fused q/k/v bias), else "" (nothing more than "true gradient ~0" is known)."""
    if _KEY.search(name) and quiet.all():
        return "key bias"
    third = quiet.size // 3
    if _FUSED.search(name) and quiet.ndim == 1 and quiet.size == 3 * third and quiet[third:2 * third].all() \
            and quiet[:third].mean() < 0.5 and quiet[2 * third:].mean() < 0.5:
        return "key bias (the middle third of the fused q/k/v bias)"
    return ""
