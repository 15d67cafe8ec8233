"""What a forward does besides computing: a parameter changed in place under ``torch.no_grad()`` (CLIP's clamped
logit scale) and a value computed under it (a teacher's target), on every backend (tests/fixtures/clamped_scale.py).

Until 2026-12-07 the jax backend lost both: torchax ignores grad mode, so JAX differentiated the teacher (its
parameters trained, which eager's never are) and cut the clamped scale's gradient, and the clamp itself was not
carried into the update; parity failed at step 1 (0.11)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import FIXTURES, assert_check_agrees, error_line, run_cli

CLAMPED = str(FIXTURES / "clamped_scale.py")


def test_no_grad_on_jax_differentiates_as_torch_does():
    """Under torch.no_grad(): an operator's result carries no gradient, and a tensor changed in place keeps the
    gradient its old value had (torch's leaf), through backends/jaxjit/patches.grad_mode."""
    import jax
    import jax.numpy as jnp
    import torch
    import torchax

    from xbridge.backends.jaxjit import patches

    env = torchax.default_env()

    def traced(x, body):
        with env, patches.grad_mode():
            return env.t2j_iso(body(env.j2t_iso(x)))

    def product(t):
        with torch.no_grad():
            frozen = t * 3
        return (t * frozen).sum()

    def clamped(t):
        with torch.no_grad():
            t.clamp_(max=0.5)
        return (t * t).sum()

    x = jnp.ones(3)
    for body in (product, clamped):
        ref = torch.ones(3, requires_grad=True)
        value = body(ref)
        value.backward()
        got_value, got_grad = jax.value_and_grad(lambda v, body=body: traced(v, body))(x)
        np.testing.assert_allclose(float(got_value), value.item())
        np.testing.assert_allclose(np.asarray(got_grad), ref.grad.numpy())


@pytest.mark.slow   # a parity of three targets
def test_a_clamped_scale_and_a_no_grad_target_pass_parity_on_every_backend(tmp_path):
    proc = run_cli("parity", CLAMPED, "--steps", "8", "--backends", "inductor-cpu,jax-cpu,xla-cpu", "--jobs", "2",
                   "--format", "json", "--out", str(tmp_path / "parity"))
    record = json.loads(proc.stdout)
    failed = [(r["target"], r.get("error"), r.get("max_loss_dev"), r.get("max_param_dev_at"))
              for r in record["targets"] if r["verdict"] != "pass"]
    assert not failed and proc.returncode == 0, failed
    assert_check_agrees(CLAMPED, record)


@pytest.mark.slow   # runs in their own processes (2 devices)
def test_a_split_parameter_changed_in_forward_is_refused_under_shard_map_and_carried_under_gspmd():
    common = ("run", f"{CLAMPED}:max_norm", "--backend", "jax-cpu", "--devices", "2", "--steps", "2")
    refused = run_cli(*common, "--sharding-mode", "shard_map")
    assert refused.returncode == 1
    assert error_line(refused) == (
        "error: the forward of program 'clamped-scale-max-norm' changes parameter 'image.weight' in place, and it is "
        "split over the mesh under shard_map, where the jax backend cannot carry the change into the next step; "
        "change it outside the forward, or run with --sharding-mode gspmd")
    carried = run_cli(*common, "--format", "json")
    eager = run_cli("run", f"{CLAMPED}:max_norm", "--steps", "2", "--format", "json")
    assert carried.returncode == 0 and eager.returncode == 0, carried.stderr[-2000:]
    np.testing.assert_allclose([s["loss"] for s in json.loads(carried.stdout)["steps"]],
                               [s["loss"] for s in json.loads(eager.stdout)["steps"]], rtol=1e-5)
