import os, time, sys
if "quiet" in sys.argv: os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax, jax.numpy as jnp
from jax.experimental import topologies
order = sys.argv[1]
def topo():
    t = time.time(); d = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices; print(f"topology: {len(d)} {d[0].device_kind} {time.time()-t:.2f}s", flush=True)
def cpu():
    t = time.time(); d = jax.devices(); print(f"jax.devices(): {d} default={jax.default_backend()} {time.time()-t:.2f}s", flush=True)
    print("  cpu compute:", float(jnp.ones(3).sum()), "backend errors:", jax._src.xla_bridge._backend_errors)
for step in order.split(","):
    {"topo": topo, "cpu": cpu}[step]()
