"""Compile cost on the compile-only TPU client: fp32 'highest' (xbridge's fp32) vs default precision vs bf16."""
import os, sys, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
devs = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
mesh = Mesh(np.array(devs), ("data",))
S = lambda *s: NamedSharding(mesh, P(*s))
def loss(ws, x):
    for w in ws: x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)
g = jax.jit(jax.grad(loss))
for dtype, prec in (("float32", "default"), ("float32", "highest"), ("bfloat16", "default")):
    ws = [jax.ShapeDtypeStruct((512, 512), jnp.dtype(dtype), sharding=S()) for _ in range(4)]
    x = jax.ShapeDtypeStruct((256, 512), jnp.dtype(dtype), sharding=S("data", None))
    with jax.default_matmul_precision(prec):
        low = jax.jit(jax.grad(loss)).lower(ws, x)
    t, c = time.time(), time.process_time()
    comp = low.compile()
    print(f"{dtype:9s} precision={prec:8s} compile wall {time.time()-t:6.2f}s cpu {time.process_time()-c:6.2f}s code {comp.memory_analysis().generated_code_size_in_bytes} load {os.getloadavg()[0]:.1f}", flush=True)
