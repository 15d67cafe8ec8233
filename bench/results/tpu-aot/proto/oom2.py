"""Several temporaries, each below HBM, together above it: does the TPU compiler refuse, and with what message?"""
import os, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
mesh = Mesh(np.array(devs), ("data",))
def f(x):
    a = jnp.sort(jnp.tanh(x @ x.T), axis=0)
    b = jnp.sort(jnp.exp(x @ x.T), axis=1)
    return a[0] + b[:, -1] + a[-1] * b[:, 0]
x = jax.ShapeDtypeStruct((49152, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
t = time.time()
try:
    c = jax.jit(f).lower(x).compile(); m = c.memory_analysis()
    print(f"fits; temp={m.temp_size_in_bytes} peak={m.peak_memory_in_bytes} ({time.time()-t:.1f}s)")
except Exception as e:
    print(f"{type(e).__name__} ({time.time()-t:.1f}s):\n{str(e)[:2500]}")
