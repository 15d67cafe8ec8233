"""Emulate a TPU VM's Mosaic IR version choice for compile-only devices: jax 0.7.1 picks the version from the
libtpu build date only when running_in_cloud_tpu_vm; here we pick it from the compile-only client's platform_version."""
import os, sys, re, datetime
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax, jax.numpy as jnp, numpy as np, libtpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from jax._src import tpu_custom_call
devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
pv = devs[0].client.platform_version
built = datetime.date.fromtimestamp(int(re.findall(r"\((\d+)\)", pv)[0]))
def ir_version_like_tpu_vm(ctx):
    # the same thresholds as jax/_src/tpu_custom_call.py:get_ir_version, against the compile-only libtpu's build date
    for (y, m, d), v in (((2025, 6, 19), 4), ((2025, 7, 25), 5), ((2025, 7, 27), 6), ((2025, 8, 14), 7)):
        if built < datetime.date(y, m, d):
            return v
    return None
mode = sys.argv[1] if len(sys.argv) > 1 else "patch"
if mode == "patch":
    tpu_custom_call.get_ir_version = ir_version_like_tpu_vm
print("libtpu", libtpu.__version__, "built", built, "-> ir version", ir_version_like_tpu_vm(None), "mode", mode)
mesh = Mesh(np.array(devs), ("data",))
spec = P("data", None, None, None)
f = jax.shard_map(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, sm_scale=0.125), mesh=mesh,
                  in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
x = jax.ShapeDtypeStruct((8, 4, 256, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
try:
    c = g.lower(x, x, x).compile(); print("OK fwd+bwd bf16 compiled; tpu_custom_calls:", c.as_text().count("tpu_custom_call"))
except Exception as e:
    print("FAIL", type(e).__name__, str(e)[:200])
