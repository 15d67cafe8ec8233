"""Sharded MLP train step compiled AOT for a compile-only TPU topology from ShapeDtypeStruct inputs."""
import os, sys, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
import libtpu
print("jax", jax.__version__, "libtpu", libtpu.__version__)
name = sys.argv[1] if len(sys.argv) > 1 else "v5e:2x2"
t = time.time()
devs = topologies.get_topology_desc(platform="tpu", topology_name=name).devices
print(f"topology {name}: {len(devs)} x {devs[0].device_kind} ({time.time()-t:.2f}s)")
mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("data", "model"))
B, D, H = 256, 1024, 4096
def loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)
def step(params, x, y):
    l, g = jax.value_and_grad(loss)(params, x, y)
    return l, jax.tree.map(lambda p, g: p - 1e-3 * g, params, g)
S = lambda *spec: NamedSharding(mesh, P(*spec))
params = {"w1": jax.ShapeDtypeStruct((D, H), jnp.bfloat16, sharding=S(None, "model")),
          "w2": jax.ShapeDtypeStruct((H, D), jnp.bfloat16, sharding=S("model", None))}
x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=S("data", None))
y = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=S("data", None))
t = time.time()
lowered = jax.jit(step, donate_argnums=0).lower(params, x, y)
print(f"lower {time.time()-t:.2f}s; type {type(lowered).__name__}")
t = time.time()
compiled = lowered.compile()
print(f"compile {time.time()-t:.2f}s; type {type(compiled).__name__}")
print("public attrs of Compiled:", [a for a in dir(compiled) if not a.startswith("_")])
ma = compiled.memory_analysis()
print("memory_analysis type:", type(ma).__name__)
for a in dir(ma):
    if not a.startswith("_"):
        print(f"   {a} = {getattr(ma, a)}")
ca = compiled.cost_analysis()
print("cost_analysis type:", type(ca).__name__, "len", len(ca) if hasattr(ca, '__len__') else None)
ca0 = ca[0] if isinstance(ca, list) else ca
for k in sorted(ca0):
    if not k.startswith("bytes accessed") or k in ("bytes accessed", "bytes accessed0{}", "bytes accessedout{}"):
        print(f"   {k!r}: {ca0[k]}")
print("   (other keys):", [k for k in ca0 if k.startswith("bytes accessed")][:12])
txt = compiled.as_text()
print("as_text chars:", len(txt))
import re
print("collectives:", {k: len(re.findall(r"= \S+ " + k + r"\(|" + k + r"-start\(", txt)) for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")})
print("first param layouts:", re.findall(r"ENTRY .*?\n(.*?)\n", txt, re.S)[:1])
print("input_shardings:", compiled.input_shardings)
print("output_shardings:", compiled.output_shardings)
print("runtime_executable:", type(compiled.runtime_executable()).__name__)
hm = compiled.runtime_executable().hlo_modules()
print("hlo_modules:", len(hm), hm[0].name)
print("compiled.compiler_ir? lowered.as_text head:", lowered.as_text()[:300].replace("\n", " | "))
open(f"/tmp/tpu_proto/compile_basic_{name.replace(':','_')}.hlo.txt", "w").write(txt)
try:
    print("execute ->", compiled(params, x, y))
except Exception as e:
    print("execute ->", type(e).__name__, str(e)[:200])
