"""Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) under jax.shard_map over the batch,
compiled fwd+bwd for a compile-only TPU topology. usage: splash.py TOPOLOGY [dtype]"""
import os, sys, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np, libtpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk, splash_attention_mask as sm
topo = sys.argv[1] if len(sys.argv) > 1 else "v5e:2x4"
dt = jnp.dtype(sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
devs = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices
mesh = Mesh(np.array(devs), ("data",))
B, H, KV, S, D = 2 * len(devs), 8, 2, 512, 128
mask = sm.MultiHeadMask([sm.CausalMask((S, S)) for _ in range(H)])
kernel = sk.make_splash_mqa_single_device(mask) if False else sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
spec = P("data", None, None, None)
def attn(q, k, v):
    # grouped-query: k/v heads repeated to the query's count (splash's own GQA entry is make_splash_mqa for 1 kv head)
    k, v = (jnp.repeat(t, H // KV, axis=1) for t in (k, v))
    return jax.vmap(kernel)(q * D ** -0.5, k, v)
f = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
q = jax.ShapeDtypeStruct((B, H, S, D), dt, sharding=NamedSharding(mesh, spec))
kv = jax.ShapeDtypeStruct((B, KV, S, D), dt, sharding=NamedSharding(mesh, spec))
for name, fn in (("fwd", f), ("fwd+bwd", jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))):
    t = time.time()
    try:
        c = jax.jit(fn).lower(q, kv, kv).compile()
        print(f"OK   libtpu {libtpu.__version__} {topo} {dt} splash {name}: {time.time()-t:.1f}s, tpu_custom_calls={c.as_text().count('tpu_custom_call')}")
    except Exception as e:
        print(f"FAIL libtpu {libtpu.__version__} {topo} {dt} splash {name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:250]}")
# and unwrapped, under plain GSPMD
try:
    jax.jit(attn).lower(q, kv, kv).compile(); print("splash without shard_map: compiled")
except Exception as e:
    print(f"splash without shard_map: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
