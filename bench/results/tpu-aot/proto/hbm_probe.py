"""The HBM size the TPU compiler assumes per device kind: one temporary larger than any chip's HBM; the compiler's
RESOURCE_EXHAUSTED message names the memory size. usage: hbm_probe.py TOPOLOGY [chip_config]"""
import os, sys, time, re
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
kw = {"chip_config_name": sys.argv[2]} if len(sys.argv) > 2 else {}
devs = topologies.get_topology_desc(platform="tpu", topology_name=sys.argv[1], **kw).devices
mesh = Mesh(np.array(devs), ("data",))
x = jax.ShapeDtypeStruct((163840, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
t = time.time()
try:
    jax.jit(lambda x: jnp.sort(jnp.tanh(x @ x.T), axis=0)[0]).lower(x).compile(); print("compiled?!")
except Exception as e:
    msg = str(e)
    m = re.search(r"would exceed memory \(size=(\d+)\)", msg)
    print(f"{sys.argv[1]} {kw} {devs[0].device_kind}: memory size {int(m.group(1)) if m else None} bytes"
          f" = {int(m.group(1))/2**30 if m else 0:.2f} GiB ({time.time()-t:.0f}s) | {msg.splitlines()[0][:160]}")
