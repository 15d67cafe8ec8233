import os
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax, libtpu
from jax.experimental import topologies
d = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
for attr in ("platform_version", "platform", "runtime_type"):
    try: print(attr, repr(getattr(d[0].client, attr)))
    except Exception as e: print(attr, "ERR", type(e).__name__, e)
print("libtpu", libtpu.__version__)
