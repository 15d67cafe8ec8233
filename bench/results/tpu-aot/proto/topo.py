"""Construct compile-only TPU topologies; print device kinds / counts / hosts."""
import sys, time, os
t0 = time.time()
import jax
from jax.experimental import topologies
print("jax", jax.__version__, "TPU_LIBRARY_PATH", os.environ.get("TPU_LIBRARY_PATH"))
try:
    import libtpu; print("libtpu", libtpu.__version__, libtpu.get_library_path())
except ImportError as e:
    print("no libtpu", e)
names = sys.argv[1:] or ["v5e:2x2", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1", "v5p:4x4x4", "v5e:2x4", "v5e:4x4", "v6e:2x4", "v5e-8", "v4-8", "v5litepod-8"]
for name in names:
    t = time.time()
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        d = topo.devices
        procs = sorted({x.process_index for x in d})
        per_host = {p: sum(1 for x in d if x.process_index == p) for p in procs}
        d0 = d[0]
        attrs = {a: getattr(d0, a, None) for a in ("platform", "device_kind", "id", "process_index", "coords", "core_on_chip", "num_cores", "slice_index")}
        print(f"OK  {name:12s} n={len(d):3d} hosts={len(procs)} per_host={set(per_host.values())} {attrs} type={type(d0).__name__} ({time.time()-t:.2f}s)")
        if name == "v5e:2x2":
            print("   dir(device):", [a for a in dir(d0) if not a.startswith('_')])
            print("   repr:", repr(d0), "| all:", [repr(x) for x in d])
    except Exception as e:
        print(f"ERR {name:12s} {type(e).__name__}: {str(e)[:300]} ({time.time()-t:.2f}s)")
print(f"total {time.time()-t0:.1f}s")
