"""The IR: precision names and string form, optimizer specs and schedules, step options, JSON round-trip, hash."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import xbridge as xb
from xbridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _program(**changes):
    base = dict(name="p", model=lambda: None, loss=lambda m, b: None, data=xb.data.Digits(batch_size=8),
                optimizer=xb.SGD(lr=0.1))
    base.update(changes)
    return xb.Program(**base)


# ---------------------------------------------------------------- precision

@pytest.mark.parametrize("name,params,compute,output,scale", [
    ("fp32", "float32", "float32", "float32", "none"),
    ("bf16-mixed", "float32", "bfloat16", "float32", "none"),
    ("bf16-true", "bfloat16", "bfloat16", "float32", "none"),
    ("fp16-mixed", "float32", "float16", "float32", "dynamic"),
])
def test_precision_names(name, params, compute, output, scale):
    p = xb.parse_precision(name)
    assert (p.params, p.compute, p.output, p.loss_scale) == (params, compute, output, scale)
    assert p.name == name


def test_precision_string_form_and_aliases():
    p = xb.parse_precision("params=fp32, compute=bf16, output=float32")
    assert p == xb.parse_precision("bf16-mixed")
    custom = xb.parse_precision("params=float32,compute=bfloat16,output=bfloat16")
    assert custom.output == "bfloat16" and custom.name == "params=float32,compute=bfloat16,output=bfloat16"
    assert xb.parse_precision("params=float32,compute=float16").loss_scale == "dynamic"


@pytest.mark.parametrize("text,fragment", [
    ("bf32", "unknown precision 'bf32'"),
    ("params=float32,compute=int8", "compute='int8' is not a dtype"),
    ("params=float32", "lacks compute"),
    ("params=float32,compute=bfloat16,params=bfloat16", "key 'params' given twice"),
    ("params=float32,colour=red,compute=bfloat16", "bad precision part 'colour=red'"),
    ("params=float32,compute=bfloat16,loss_scale=dynamic", "only applies when compute or params is float16"),
])
def test_precision_errors(text, fragment):
    with pytest.raises(ConfigError, match="precision") as info:
        xb.parse_precision(text)
    assert fragment in str(info.value)


def test_program_normalises_precision():
    assert _program(precision="bf16-mixed").precision == xb.Precision("float32", "bfloat16", "float32")


# ---------------------------------------------------------------- optimizers and schedules

def test_warmup_cosine_values():
    s = xb.WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [s.factor(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == pytest.approx(1.0)
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * 0.5)          # half-way through the decay
    assert s.factor(14) == pytest.approx(0.1) and s.factor(100) == pytest.approx(0.1)
    assert xb.Constant().factor(12345) == 1.0


@pytest.mark.parametrize("make,fragment", [
    (lambda: xb.SGD(lr=0), "SGD lr must be a number > 0"),
    (lambda: xb.SGD(lr=0.1, momentum=1.5), "SGD momentum"),
    (lambda: xb.SGD(lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda: xb.AdamW(lr=1e-3, betas=(0.9,)), "AdamW betas"),
    (lambda: xb.AdamW(lr=1e-3, eps=0), "AdamW eps"),
    (lambda: xb.AdamW(lr=1e-3, weight_decay=-1), "AdamW weight_decay"),
    (lambda: xb.AdamW(lr=1e-3, schedule="cosine"), "schedule must be xb.Constant() or xb.WarmupCosine"),
    (lambda: xb.WarmupCosine(10, 5), "total_steps (5) must be an int > warmup_steps (10)"),
    (lambda: xb.StepOptions(grad_accum=0), "grad_accum must be a positive int"),
    (lambda: xb.StepOptions(clip_grad_norm=-1.0), "clip_grad_norm must be a number > 0"),
    (lambda: _program(optimizer="adam"), "optimizer must be xb.SGD(...) or xb.AdamW(...), got str"),
    (lambda: _program(data=[1, 2]), "has no batch(step, seed) method"),
    (lambda: _program(model=3), "model must be a function that builds the nn.Module"),
    (lambda: _program(seed=-1), "seed must be an int in [0, 2**63)"),
    (lambda: _program(step=xb.StepOptions(grad_accum=3)), "batch_size 8 is not divisible by grad_accum 3"),
    (lambda: xb.Mesh(data=-1, model=-1), "at most one mesh axis may have size -1"),
    (lambda: xb.Mesh(data=0), "mesh axis 'data' has size 0"),
    (lambda: xb.Mesh(), "needs at least one axis"),
    (lambda: xb.Sharding(params={"fc[": ("model",)}), "is not a valid regex"),
    (lambda: xb.Sharding(params={"fc": ("model", 3)}), "spec entry 3 must be None"),
])
def test_ir_validation_errors(make, fragment):
    with pytest.raises(ConfigError) as info:
        make()
    assert fragment in str(info.value)


def test_adamw_keeps_every_hyperparameter():
    from xbridge.ir.serialize import to_config

    cfg = to_config(xb.AdamW(lr=3e-4))
    assert cfg == {"kind": "AdamW", "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                   "schedule": {"kind": "Constant"}}


# ---------------------------------------------------------------- JSON round-trip and hash

def _full_program():
    return _program(
        data=xb.data.ByteText.python_stdlib(seq_len=65, batch_size=8),
        optimizer=xb.AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                           schedule=xb.WarmupCosine(20, 1000, min_ratio=0.1)),
        precision="params=float32,compute=bfloat16,output=bfloat16",
        mesh=xb.Mesh(data=-1, model=2),
        sharding=xb.Sharding(params={r".*\.q\.weight": ("model", None), r"emb": (("data", "model"),)},
                             batch=("data",), fsdp="data"),
        step=xb.StepOptions(grad_accum=2, clip_grad_norm=1.0),
        seed=7,
        eval=xb.Eval(data=xb.data.ByteText.python_stdlib(seq_len=65, batch_size=4), every=10, batches=2),
    )


def test_json_round_trip_of_every_field():
    program = _full_program()
    text = json.dumps(program.config())
    back = xb.Program.from_config(json.loads(text), model=program.model, loss=program.loss)
    assert back == program
    assert back.config() == program.config()
    assert back.config_hash == program.config_hash
    assert back.sharding.params[r"emb"] == (("data", "model"),)
    assert back.mesh.axes == (("data", -1), ("model", 2))
    assert set(program.config()) == {"kind", "name", "data", "optimizer", "precision", "mesh", "sharding", "step",
                                     "seed", "eval"}


def test_hash_changes_with_any_field_and_ignores_rule_order():
    program = _full_program()
    assert program.replace(seed=8).config_hash != program.config_hash
    assert program.replace(precision="fp32").config_hash != program.config_hash
    reordered = program.replace(sharding=xb.Sharding(
        params={r"emb": (("data", "model"),), r".*\.q\.weight": ("model", None)}, batch=("data",), fsdp="data"))
    assert reordered.config_hash == program.config_hash


def test_hash_is_stable_across_processes():
    code = ("import sys; sys.path.insert(0, 'tests'); from test_ir import _full_program; "
            "print(_full_program().config_hash)")
    hashes = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": str(seed)}, cwd=ROOT).stdout.strip()
              for seed in (1, 2)}
    assert hashes == {_full_program().config_hash}
    assert len(next(iter(hashes))) == 16


def test_import_xbridge_loads_no_ml_framework():
    code = ("import sys, xbridge as xb; xb.Program(name='p', model=lambda: None, loss=lambda m, b: None, "
            "data=xb.data.ByteText.python_stdlib(9, 2), optimizer=xb.AdamW(lr=1e-3)).config_hash; "
            "import xbridge.cli, xbridge.contract.registry; xbridge.contract.registry.entry_points(); "
            "print(sorted(m for m in ('torch', 'jax', 'torch_xla', 'torchax', 'optax', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_schedule_matches_torch_lambda_lr():
    import torch

    schedule = xb.WarmupCosine(3, 10, min_ratio=0.2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5 * schedule.factor(t) for t in range(12)], rel=1e-12)
    assert math.isclose(seen[2], 0.5)
