"""The sharding plan: mesh resolution, rule matching, shard shapes and bytes, and every error case."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import xbridge as xb
from xbridge.errors import PlanError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 16)         # weight (96, 16)
        self.q = nn.Linear(16, 32)              # weight (32, 16), bias (32,)
        self.o = nn.Linear(32, 16, bias=False)  # weight (16, 32)
        self.norm = nn.LayerNorm(16)            # weight (16,), bias (16,)

    def forward(self, x):
        return self.norm(self.o(self.q(self.emb(x))))


def _program(mesh=None, rules=None, sharding=None, batch_size=24, precision="fp32", grad_accum=1):
    return xb.Program(
        name="net", model=Net, loss=lambda m, b: m(b["tokens"]).sum(),
        data=xb.data.ByteText.python_stdlib(seq_len=8, batch_size=batch_size),
        optimizer=xb.SGD(lr=0.1), precision=precision, mesh=mesh or xb.Mesh(data=-1, model=2),
        sharding=sharding or xb.Sharding(params=rules or {}, batch=("data",)),
        step=xb.StepOptions(grad_accum=grad_accum))


def test_mesh_resolution():
    assert xb.Mesh(data=-1, model=2).resolve(8) == {"data": 4, "model": 2}
    assert list(xb.Mesh(model=2, data=-1).resolve(8)) == ["model", "data"]
    assert xb.Mesh(data=4).resolve(4) == {"data": 4}
    with pytest.raises(PlanError, match=r"mesh \(data=-1 x model=3\) cannot fill 8 devices"):
        xb.Mesh(data=-1, model=3).resolve(8)
    with pytest.raises(PlanError, match=r"mesh \(data=2 x model=2\) has 4 devices but 8 are in use"):
        xb.Mesh(data=2, model=2).resolve(8)


def test_plan_shapes_specs_and_bytes():
    plan = xb.plan(_program(rules={r"q\.weight": ("model", None), r"q\.bias": ("model",),
                                   r"o\.weight": (None, "model"), r"emb\.weight": (("data", "model"),)}),
                   devices=8)
    assert plan.axis_sizes == {"data": 4, "model": 2}
    q = plan.param("q.weight")
    assert (q.shape, q.spec, q.shard_shape, q.dtype) == ((32, 16), ("model", None), (16, 16), "float32")
    assert (q.bytes, q.shard_bytes) == (32 * 16 * 4, 16 * 16 * 4)
    assert plan.param("q.bias").shard_shape == (16,)
    assert plan.param("o.weight").shard_shape == (16, 16)
    emb = plan.param("emb.weight")
    assert emb.spec == (("data", "model"), None) and emb.shard_shape == (12, 16)   # 96 / (4*2)
    norm = plan.param("norm.weight")
    assert norm.spec == (None,) and norm.rule is None and not norm.sharded and norm.shard_shape == (16,)
    expected = sum(p.shard_bytes for p in plan.params)
    assert plan.bytes_per_device == expected == (12 * 16 + 16 * 16 + 16 + 16 * 16 + 16 + 16) * 4
    assert plan.total_params == sum(p.numel() for p in Net().parameters())
    assert [p.name for p in plan.params] == [n for n, _ in Net().named_parameters()]


def test_plan_dtype_follows_precision():
    plan = xb.plan(_program(precision="bf16-true"), devices=2)
    assert {p.dtype for p in plan.params} == {"bfloat16"}
    assert plan.param("q.weight").bytes == 32 * 16 * 2


def test_presets():
    dp = xb.plan(_program(mesh=xb.Mesh(data=-1), sharding=xb.sharding.data_parallel()), devices=4)
    assert all(not p.sharded for p in dp.params) and dp.batch == ("data",)
    fs = xb.plan(_program(mesh=xb.Mesh(data=-1), sharding=xb.sharding.fsdp("data")), devices=4)
    assert fs.param("emb.weight").spec == ("data", None)      # largest divisible dimension (96)
    assert fs.param("o.weight").spec == (None, "data")        # (16, 32): 32 is the largest
    assert fs.param("q.bias").spec == ("data",)
    assert fs.param("q.weight").rule == "fsdp:data"
    odd = xb.plan(_program(mesh=xb.Mesh(data=-1), sharding=xb.sharding.fsdp("data")), devices=3)
    assert odd.param("norm.weight").spec == (None,)            # 16 is not divisible by 3: replicated
    assert odd.param("emb.weight").spec == ("data", None)


@pytest.mark.parametrize("kwargs,devices,pattern", [
    (dict(rules={r"q\..*": ("model",), r".*\.weight": (None,)}), 2,
     r"parameter 'q.weight' of shape \(32, 16\) is matched by two sharding rules, 'q\\\.\.\*' and"),
    (dict(rules={r"k\.weight": ("model", None)}), 2,
     r"sharding rule 'k\\.weight' \(spec \('model', None\)\) matches no parameter of program 'net'"),
    (dict(rules={r"q\.weight": ("tensor", None)}), 2,
     r"parameter 'q.weight' of shape \(32, 16\) \(rule 'q\\.weight', spec \('tensor', None\)\): mesh axis "
     r"'tensor' is not in the mesh \(axes: data, model\)"),
    (dict(mesh=xb.Mesh(data=2, model=2)), 8, r"mesh \(data=2 x model=2\) has 4 devices but 8 are in use"),
    (dict(mesh=xb.Mesh(data=-1, model=3), rules={r"q\.weight": (None, "model")}), 6,
     r"parameter 'q.weight' of shape \(32, 16\) \(rule 'q\\.weight', spec \(None, 'model'\)\): dimension 1 \(16\) "
     r"is not divisible by mesh axis 'model' \(size 3\)"),
    (dict(rules={r"q\.bias": ("model", None)}), 2,
     r"parameter 'q.bias' of shape \(32,\) \(rule 'q\\.bias', spec \('model', None\)\): the spec has 2 entries "
     r"but the tensor has rank 1"),
    (dict(rules={r"q\.weight": ("model", "model")}), 2, r"mesh axis 'model' is used on more than one dimension"),
    (dict(batch_size=6, mesh=xb.Mesh(data=-1)), 4,
     r"batch spec \('data',\): the micro-batch of 6 examples .* not divisible by mesh axis 'data' of size 4"),
    (dict(batch_size=8, grad_accum=4, mesh=xb.Mesh(data=-1)), 4,
     r"micro-batch of 2 examples \(batch_size 8 / grad_accum 4\)"),
    (dict(sharding=xb.Sharding(batch=("rows",))), 2, r"batch spec \('rows',\): mesh axis 'rows' is not in the mesh"),
    (dict(sharding=xb.Sharding(batch=("data",), fsdp="shards")), 2, r"fsdp axis 'shards' is not in the mesh"),
])
def test_plan_errors_name_parameter_shape_rule_and_axis(kwargs, devices, pattern):
    with pytest.raises(PlanError) as info:
        xb.plan(_program(**kwargs), devices=devices)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern, message), message


def test_plan_of_shipped_gpt_with_tensor_parallel(gpt_program):
    program = gpt_program.replace(mesh=xb.Mesh(data=-1, model=2))
    plan = xb.plan(program, devices=8)
    assert plan.axis_sizes == {"data": 4, "model": 2}
    q = plan.param("blocks.0.q.weight")
    assert q.spec == ("model", None) and q.shard_shape == (128, 256)
    down = plan.param("blocks.3.down.weight")
    assert down.spec == (None, "model") and down.shard_shape == (256, 512)
    assert plan.param("embed.weight").spec == (None, None)
    assert plan.total_params == 3_346_944


def test_plan_builds_on_meta_device_without_allocating():
    built = []

    def model():
        m = Net()
        built.append(next(m.parameters()).device)
        return m

    xb.plan(_program().replace(model=model), devices=2)
    assert built == [torch.device("meta")]
