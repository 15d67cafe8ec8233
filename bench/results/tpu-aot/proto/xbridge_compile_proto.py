"""Prototype of `xbridge compile PROG --backend jax-tpu --topology T` WITHOUT editing xbridge: build xbridge's
JaxExecutable on compile-only TPU devices, with every array abstract (jax.ShapeDtypeStruct + NamedSharding), and
lower + compile its train step and its evaluation with the TPU compiler. The device-touching calls of
backends/jaxjit/executable.py are swapped for abstract ones by patching (the design sketch says where the real
code needs an abstract path).

usage: xbridge_compile_proto.py PROGRAM_REF TOPOLOGY [key=value ...]
  keys: mode=gspmd|shard_map precision=fp32|bf16-mixed attention=auto|flash scan=0|1 remat=none|full|dots
        batch=N devices=N flashfix=0|1 (flashfix: wrap the Pallas kernel in jax.shard_map over the batch axes)
        chip_config=megacore|default
"""
from __future__ import annotations

import os, sys, time, re, json, contextlib
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")   # quiet libtpu on a machine with no TPU
os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")                # the process's own backend: CPU (no TPU init attempt)
sys.path.insert(0, os.environ.get("XBRIDGE_SRC", "/tmp/xbridge_wt"))   # a copy of /work/main's working tree (being edited by others)
sys.dont_write_bytecode = True

import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import topologies

t_start = time.time()
ref, topo_name, *kv = sys.argv[1:]
opts = dict(a.split("=", 1) for a in kv)
jax.config.update("jax_compilation_cache_dir", "/tmp/tpu_proto/jaxcache")   # not xbridge's own cache dir
jax.config.update("jax_enable_compilation_cache", False)  # compile-only executables cannot be serialized into it

kw = {}
if opts.get("chip_config"):
    kw["chip_config_name"] = opts["chip_config"]
devices = topologies.get_topology_desc(platform="tpu", topology_name=topo_name, **kw).devices
n = int(opts.get("devices", len(devices)))
kind = devices[0].device_kind

from xbridge.program_file import load_program
from xbridge.planner import plan as make_plan
from xbridge.contract import Target
from xbridge.contract import registry
try:
    from xbridge.data.source import checked_batch
except ImportError:   # the tree before the data/contract -> data/source rename
    from xbridge.data.contract import checked_batch
from xbridge.run.rng import with_rng
from xbridge.weights import meta_model
import backends.jaxjit.executable as jexe
import backends.jaxjit.checkpoint_shards as jshards
import backends.jaxjit.attention as jattn
from backends.jaxjit import patches, step_builders
from backends.jaxjit.lowering import matmul_precision
from backends.jaxjit.feeding import to_jax_dtype

program = load_program(ref)
step = program.step
changes = {}
if "precision" in opts: changes["precision"] = opts["precision"]
import dataclasses
if "batch" in opts:   # the global batch (xbridge compile --fit would search it); the program's data source, resized
    program = program.replace(data=dataclasses.replace(program.data, batch_size=int(opts["batch"])))
step = dataclasses.replace(step, attention=opts.get("attention", step.attention),
                           scan_layers=bool(int(opts.get("scan", int(step.scan_layers)))),
                           remat=opts.get("remat", step.remat))
program = program.replace(step=step, **{k: v for k, v in changes.items() if k == "precision"})
if "model" in opts:   # tensor-parallel axis size (the rest data-parallel)
    from xbridge.ir.mesh import Mesh as XbMesh
    program = program.replace(mesh=XbMesh(data=-1, model=int(opts["model"])))
mode = opts.get("mode", "gspmd")
plan = make_plan(program, n)
target = Target("jax", "tpu")
backend = registry.load("jax").backend

# ---- abstract stand-ins for the device-touching calls --------------------------------------------------------
def abstract_placed(source, sharding, convert=None):
    dtype = (convert(np.empty((0,), source.dtype)) if convert is not None else np.empty((0,), source.dtype)).dtype
    return jax.ShapeDtypeStruct(tuple(source.shape), dtype, sharding=sharding)

def abstract_device_put(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, sharding=s),
                        tree, shardings)

@contextlib.contextmanager
def abstract_devices():
    saved = (jax.devices, jshards.placed, jax.device_put)
    jax.devices = lambda backend=None: list(devices[:n])
    jexe.checkpoint_shards.placed = abstract_placed
    jax.device_put = abstract_device_put
    try:
        yield
    finally:
        jax.devices, jexe.checkpoint_shards.placed, jax.device_put = saved

if opts.get("backport") == "1":
    # jax 0.7.2's get_ir_version for jax 0.7.1: the Mosaic IR version from the *lowering's* backend (compile-only
    # clients included), 7 for a libtpu built before 2025-08-14 (0.0.20), else the latest (8)
    import datetime
    from jax._src import tpu_custom_call
    def get_ir_version(ctx):
        pv = devices[0].client.platform_version
        found = re.findall(r"\((\d+)\)", pv.split("\n")[-1])
        if ctx.is_forward_compat() or "TFRT TPU" not in pv or len(found) != 1:
            return 7
        return 7 if datetime.date.fromtimestamp(int(found[0])) < datetime.date(2025, 8, 14) else None
    tpu_custom_call.get_ir_version = get_ir_version

if opts.get("flashfix") == "1":
    # the kernel route wrapped in shard_map over the mesh axes the batch is split on (the rest replicated)
    real = jattn.pallas_flash_attention
    def sharded_flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        from torchax import interop
        mesh = EX.mesh
        bspec = tuple(plan.batch) if plan.batch else (None,)
        spec = P(*bspec, *([None] * (query.ndim - 1)))
        def inner(q, k, v, *m):
            return real(q, k, v, m[0] if m else None, dropout_p, is_causal, scale, enable_gqa)
        args = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
        mspec = (P(*([None] * attn_mask.ndim)),) if attn_mask is not None else ()
        return jax.shard_map(inner, mesh=mesh, in_specs=(spec, spec, spec) + mspec, out_specs=spec,
                             check_vma=False)(*args)
    jattn.pallas_flash_attention = sharded_flash

# scanned layers: the stacking of abstract arrays (jnp.stack needs real ones)
from backends.jaxjit.layer_stacks import Stacks
_real_stack = Stacks.stack
def abstract_stack(self, flat, stack=jnp.stack):
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in flat.values()):
        return _real_stack(self, flat, lambda xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype))
    return _real_stack(self, flat, stack)
Stacks.stack = abstract_stack

# the loss's parameter census traces buffers as arguments too (the original closes over them: concrete arrays only)
def params_the_loss_uses(self, params, buffers, float_dtype):
    from backends.jaxjit.lowering import matmul_precision as mp
    accum = self.program.step.grad_accum
    batch = {k: jax.ShapeDtypeStruct((v.shape[0] // accum, *v.shape[1:]), to_jax_dtype(v[:1], float_dtype).dtype)
             for k, v in checked_batch(self.program.data, 0, self.program.seed).items()}
    env = self.lowered.env
    key = env.param.prng
    try:
        with mp(self.program.precision.compute):
            closed = jax.make_jaxpr(lambda p, bu, b: self.lowered(p, bu, b)[0])(params, buffers, batch)
    finally:
        env.param.prng = key
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    used = {path[0].key for (path, _), var in zip(flat, closed.jaxpr.invars[:len(flat)]) if id(var) in read}
    return [n for n in self.lowered.param_names if n in used]
jexe.JaxExecutable._params_the_loss_uses = params_the_loss_uses

# ---- build the executable abstractly ---------------------------------------------------------------------------
patches.apply()
if opts.get("meta") == "1":   # the torch model built on the meta device: no host copy of the weights at all
    import torch
    _real_build = jexe.build_model
    jexe.build_model = lambda program, weights, device: _real_build(program, weights, torch.device("meta"))
with abstract_devices():
    EX = jexe.JaxExecutable(with_rng(program), plan, target, mode)
    real_tx = EX.tx
    import optax
    EX.tx = optax.GradientTransformation(lambda p: jax.eval_shape(real_tx.init, p), real_tx.update)
    model = meta_model(program)
    weights = {k: jax.ShapeDtypeStruct(tuple(v.shape), np.float32 if v.is_floating_point() else np.dtype(str(v.dtype).replace("torch.", "")))
               for k, v in model.state_dict().items()}
    t = time.time()
    EX.init(weights)
    t_init = time.time() - t
# the state as the step's in_shardings say (stacked groups, optimizer state: shardings from state_specs)
EX.state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), EX.state, EX.state_shardings)
float_dtype = jnp.dtype(program.precision.params)
host = checked_batch(program.data, 0, program.seed)
batch = {k: jax.ShapeDtypeStruct(v.shape, to_jax_dtype(v[:1], float_dtype).dtype, sharding=EX.batch_sharding)
         for k, v in host.items()}

def report(name, fn, *args):
    t = time.time()
    with matmul_precision(program.precision.compute):
        lowered = fn.lower(*args)
    t_lower = time.time() - t
    t = time.time(); c0 = time.process_time()
    compiled = lowered.compile()
    t_compile = time.time() - t; cpu_compile = time.process_time() - c0
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    txt = compiled.as_text()
    if "dump" in opts:
        os.makedirs(opts["dump"], exist_ok=True)
        open(os.path.join(opts["dump"], f"{name}.stablehlo.mlir"), "w").write(lowered.as_text())
        open(os.path.join(opts["dump"], f"{name}.tpu.optimized.hlo.txt"), "w").write(txt)
    from collectives import collectives
    cbytes = collectives(txt)
    coll = {}
    for kindname in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        c = len(re.findall(r"= [^=]*? " + kindname + r"(-start)?\(", txt))
        if c: coll[kindname] = c
    row = dict(fn=name, lower_s=round(t_lower, 2), compile_s=round(t_compile, 2), compile_cpu_s=round(cpu_compile, 2), load1=round(os.getloadavg()[0], 1),
               argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes, temp=ma.temp_size_in_bytes,
               alias=ma.alias_size_in_bytes, code=ma.generated_code_size_in_bytes, peak=ma.peak_memory_in_bytes,
               flops=ca.get("flops"), bytes_accessed=ca.get("bytes accessed"), collectives=coll, collective_bytes=cbytes,
               tpu_custom_calls=txt.count('custom_call_target="tpu_custom_call"'))
    print(json.dumps(row))
    return compiled

print(f"# {program.name} on {topo_name} ({n} x {kind}), mode={mode}, precision={program.precision}, "
      f"attention={program.step.attention}, scan={program.step.scan_layers}, remat={program.step.remat}, "
      f"mesh={dict(EX.mesh.shape)}, batch spec={EX.batch_spec}, abstract init {t_init:.2f}s")
try:
    report("train_step", EX.jitted, EX.state, batch)
except Exception as e:
    print("train_step FAILED:", type(e).__name__, str(e).strip().splitlines()[0][:300])
try:
    report("eval_step", step_builders.eval_step(EX), EX.state["params"], EX.state["buffers"], batch)
except Exception as e:
    print("eval_step FAILED:", type(e).__name__, str(e).strip().splitlines()[0][:300])
print(f"# total {time.time()-t_start:.1f}s")
