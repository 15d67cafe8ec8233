"""What the TPU compiler says when a program does not fit in HBM (compile-only v5e: 16 GB per chip)."""
import os, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
for probe in ("memory_stats", "addressable_memories", "default_memory"):
    try: print(probe, "->", getattr(devs[0], probe)())
    except Exception as e: print(probe, "->", type(e).__name__, str(e)[:120])
mesh = Mesh(np.array(devs), ("data",))
f = jax.jit(lambda x: jnp.sort(jnp.tanh(x @ x.T), axis=0)[0])
for rows in (32768, 81920):
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
    t = time.time()
    try:
        c = f.lower(x).compile()
        m = c.memory_analysis()
        print(f"rows={rows}: fits; temp={m.temp_size_in_bytes} peak={m.peak_memory_in_bytes} ({time.time()-t:.1f}s)")
    except Exception as e:
        print(f"rows={rows}: {type(e).__name__} ({time.time()-t:.1f}s):\n{str(e)[:1500]}")
