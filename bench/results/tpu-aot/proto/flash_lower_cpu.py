"""No libtpu: lower (not compile) the Pallas flash kernel for platform 'tpu' over a 4-device CPU mesh.
jax.jit(f).trace(*args).lower(lowering_platforms=('tpu',)) runs JAX's lowering rules for TPU, Mosaic included."""
import os
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 4)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental.pallas.ops.tpu import flash_attention as fa
mesh = Mesh(np.array(jax.devices()), ("data",))
spec = P("data", None, None, None)
x = jax.ShapeDtypeStruct((8, 4, 256, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
direct = lambda q, k, v: fa.flash_attention(q, k, v, causal=True, sm_scale=0.125)
mapped = jax.shard_map(direct, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
for name, f in (("gspmd", direct), ("shard_map", mapped)):
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    try:
        low = g.trace(x, x, x).lower(lowering_platforms=("tpu",))
        txt = low.as_text()
        print(f"{name}: lowered for tpu, tpu_custom_call x{txt.count('tpu_custom_call')}")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {str(e)[:150]}")
    try:
        g.lower(x, x, x)
        print(f"{name}: lowered for cpu (no interpret mode)")
    except Exception as e:
        print(f"{name} on cpu: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
