"""Compile the SPMD program torch_xla built (HLO with sharding annotations) for a compile-only TPU topology through
JAX's compile-only TPU client, with the compile options torch_xla's PjRtComputationClient::Compile uses for a
sharded program (use_spmd_partitioning, allow_spmd_sharding_propagation_to_output={true}, num_partitions=N,
num_replicas=1, device assignment 1xN)."""
import os, sys, time, re
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax, libtpu
from jax._src.lib import _jax, xla_client as xc
from jax._src import xla_bridge as xb, compiler
from jax.experimental import topologies
src, topo_name = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "v5e:2x2")
devs = topologies.get_topology_desc(platform="tpu", topology_name=topo_name).devices
client = devs[0].client
n = len(devs)
print(f"libtpu {libtpu.__version__}; {topo_name}: {n} x {devs[0].device_kind}; client {type(client).__name__}")
if src.endswith(".pb"):
    proto = open(src, "rb").read()
else:
    text = open(src).read()
    module = _jax.hlo_module_from_text(text)
    proto = module.as_serialized_hlo_module_proto()
mlir_bc = _jax.mlir.hlo_to_stablehlo(proto)       # the same converter as torch_xla's XLA_STABLEHLO_COMPILE path
print("stablehlo bytes", len(mlir_bc))
# torch_xla marks donated parameters with the module's buffer_donor (HloModule header, HloModuleProto.buffer_donor);
# hlo_to_stablehlo drops it, so it is put back as jax.buffer_donor arg attributes (what JAX's own donation emits)
donors = []
if not src.endswith(".pb"):
    m = re.search(r"buffer_donor=\{([^}]*(?:\}[^}]*)*?)\s*\}, entry", text[:200000])
    if m:
        donors = sorted({int(d) for d in re.findall(r"\((\d+), \{\}\)", m.group(1))})
if donors and os.environ.get("KEEP_DONORS", "1") == "1":
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir
    with jmlir.make_ir_context():
        module = ir.Module.parse(mlir_bc)
        main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        args = main.arguments if hasattr(main, "arguments") else main.regions[0].blocks[0].arguments
        arg_attrs = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else [ir.DictAttr.get({}) for _ in args]
        new = []
        for i, a in enumerate(arg_attrs):
            d = {na.name: na.attr for na in ir.DictAttr(a)}
            if i in donors:
                d["jax.buffer_donor"] = ir.BoolAttr.get(True)
            new.append(ir.DictAttr.get(d))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(new)
        mlir_bc = jmlir.module_to_bytecode(module)
    print(f"buffer donors restored: {len(donors)} parameters")
opts = xc.CompileOptions()
ebo = opts.executable_build_options
ebo.num_replicas = 1
ebo.num_partitions = n
ebo.use_spmd_partitioning = True
ebo.allow_spmd_sharding_propagation_to_output = [True]
ebo.device_assignment = xc.DeviceAssignment.create(np.array([[d.id for d in devs]]))
t = time.time()
exe = client.compile(mlir_bc, executable_devices=_jax.DeviceList(tuple(devs)), compile_options=opts)
print(f"compiled in {time.time()-t:.2f}s -> {type(exe).__name__}: {[a for a in dir(exe) if not a.startswith('_')]}")
mem = exe.get_compiled_memory_stats()
print("memory:", {k: getattr(mem, k) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes", "alias_size_in_bytes", "peak_memory_in_bytes")})
ca = exe.cost_analysis() if hasattr(exe, "cost_analysis") else None
if ca is not None:
    ca0 = ca[0] if isinstance(ca, list) else ca
    print("cost:", {k: ca0[k] for k in ("flops", "bytes accessed", "transcendentals") if k in ca0})
hlo = exe.hlo_modules()[0].to_string()
print("optimized HLO chars", len(hlo), "collectives:", {k: len(re.findall(r"\b" + k + r"(-start)?\(", hlo)) for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")})
print("entry params:", re.findall(r"parameter\(\d+\)", hlo)[:3], "| first param line:", next(l for l in hlo.splitlines() if "parameter(0)" in l and "ENTRY" not in l).strip()[:200])
out = src.rsplit(".", 1)[0] + f".tpu_{topo_name.replace(':','_')}.optimized.hlo.txt"
open(out, "w").write(hlo); print("wrote", out)
