import os
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax
from jax._src import xla_bridge as xb
from jax.experimental import topologies
topo = xb.make_pjrt_tpu_topology("v5e:2x2")
print("topology type", type(topo), [a for a in dir(topo) if not a.startswith("__")])
print("platform", topo.platform, "version", topo.platform_version)
d = topo._make_compile_only_devices()
c = d[0].client
print("client type", type(c), [a for a in dir(c) if not a.startswith("__")])
