import os, sys, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
t0 = time.time()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
t_imp = time.time() - t0
import libtpu
name = sys.argv[1]
t = time.time(); devs = topologies.get_topology_desc(platform="tpu", topology_name=name).devices; t_topo = time.time() - t
mesh = Mesh(np.array(devs).reshape(-1, 2), ("data", "model"))
S = lambda *spec: NamedSharding(mesh, P(*spec))
def loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"]); return jnp.mean((h @ params["w2"] - y) ** 2)
def step(params, x, y):
    l, g = jax.value_and_grad(loss)(params, x, y); return l, jax.tree.map(lambda p, g: p - 1e-3 * g, params, g)
times = []
for D in (1024, 2048, 512):
    H = 4 * D
    params = {"w1": jax.ShapeDtypeStruct((D, H), jnp.bfloat16, sharding=S(None, "model")),
              "w2": jax.ShapeDtypeStruct((H, D), jnp.bfloat16, sharding=S("model", None))}
    x = jax.ShapeDtypeStruct((256, D), jnp.bfloat16, sharding=S("data", None))
    t = time.time(); c = jax.jit(step).lower(params, x, x).compile(); times.append(round(time.time() - t, 2))
print(f"libtpu {libtpu.__version__} {name} n={len(devs)} import {t_imp:.2f}s topo(load libtpu) {t_topo:.2f}s compiles {times} total {time.time()-t0:.1f}s")
