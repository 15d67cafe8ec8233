import os, time
t0=time.time()
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax
from jax.experimental import topologies
for name, kw in [("v5p:4x4x4", {}), ("v5e:2x4", {}), ("v5e:2x4", dict(chips_per_host_bounds=(2,4,1))), ("v5e:1x1", dict(chips_per_host_bounds=(1,1,1)))]:
    d = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices
    print(name, kw, len(d), "hosts", len({x.process_index for x in d}))
print(f"{time.time()-t0:.2f}s")
