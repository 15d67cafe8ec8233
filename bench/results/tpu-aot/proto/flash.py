"""Pallas TPU flash attention compiled for a compile-only TPU topology: plain GSPMD vs shard_map, fwd+bwd.
usage: flash.py TOPOLOGY [dtype] [modes] ; prints one line per case."""
import os, sys, time, traceback
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
from jax.experimental.pallas.ops.tpu import flash_attention as fa
import libtpu
topo = sys.argv[1] if len(sys.argv) > 1 else "v5e:2x2"
dtypes = (sys.argv[2] if len(sys.argv) > 2 else "float32,bfloat16").split(",")
modes = (sys.argv[3] if len(sys.argv) > 3 else "gspmd,shard_map").split(",")
devs = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices
n = len(devs)
heads_axis = 2 if n >= 8 else 1
mesh = Mesh(np.array(devs).reshape(n // heads_axis, heads_axis), ("data", "model"))
print(f"jax {jax.__version__} libtpu {libtpu.__version__} {topo}: {n} x {devs[0].device_kind}, mesh {dict(mesh.shape)}", flush=True)
B, H, S, D = 2 * n, 4, 256, 64
spec = P("data", "model", None, None)

def attn(q, k, v, ab, causal):
    return fa.flash_attention(q, k, v, ab, causal=causal, sm_scale=D ** -0.5)

def wrapped(mode, causal, with_ab):
    if mode == "gspmd":
        f = lambda q, k, v, ab: attn(q, k, v, ab, causal)
    else:
        inner = lambda q, k, v, ab: attn(q, k, v, ab, causal)
        if with_ab:
            f = jax.shard_map(inner, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False)
        else:
            g = jax.shard_map(lambda q, k, v: inner(q, k, v, None), mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
            f = lambda q, k, v, ab: g(q, k, v)
    return f

for dtype in dtypes:
    dt = jnp.dtype(dtype)
    for mode in modes:
        for causal, with_ab in ((True, False), (False, True)):
            f = wrapped(mode, causal, with_ab)
            def loss(q, k, v, ab):
                return jnp.sum(f(q, k, v, ab).astype(jnp.float32) ** 2)
            def fwd(q, k, v, ab): return f(q, k, v, ab)
            def bwd(q, k, v, ab): return jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ab)
            sh = NamedSharding(mesh, spec)
            qkv = jax.ShapeDtypeStruct((B, H, S, D), dt, sharding=sh)
            ab = jax.ShapeDtypeStruct((B, H, S, S), jnp.float32, sharding=sh) if with_ab else None
            for which, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
                t = time.time()
                try:
                    c = jax.jit(fn).lower(qkv, qkv, qkv, ab).compile()
                    txt = c.as_text()
                    ncall = txt.count('custom_call_target="tpu_custom_call"')
                    print(f"OK   {dtype:8s} {mode:9s} causal={causal!s:5s} ab={with_ab!s:5s} {which:8s} {time.time()-t:5.2f}s  tpu_custom_calls={ncall} temp={c.memory_analysis().temp_size_in_bytes}", flush=True)
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    first = next((l for l in msg if "rror" in l or "Mosaic" in l or "ersion" in l), msg[0] if msg else "")
                    print(f"FAIL {dtype:8s} {mode:9s} causal={causal!s:5s} ab={with_ab!s:5s} {which:8s} {time.time()-t:5.2f}s  {type(e).__name__}: {first[:300]}", flush=True)
