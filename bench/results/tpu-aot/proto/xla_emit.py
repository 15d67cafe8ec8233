"""torch_xla 2.9 on CPU, SPMD over 4 virtual devices: a tiny sharded MLP train step (fwd, bwd, SGD update).
Writes what torch_xla can hand out for the step: HLO text and proto (_XLAC._get_xla_tensors_hlo[_proto]),
StableHLO (xm.get_stablehlo / _get_stablehlo bytecode), and XLA's own dump (--xla_dump_to) when it compiles."""
import os, sys, time
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tpu_proto/xla_out"
os.environ["PJRT_DEVICE"] = "CPU"; os.environ["CPU_NUM_DEVICES"] = "4"
os.environ["XLA_FLAGS"] = f"--xla_dump_to={out}/dump"
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np, torch
import torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
xr.use_spmd()
dev = torch_xla.device()
mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
torch.manual_seed(0)
B, D, H = 16, 256, 1024
w1 = torch.randn(D, H, device=dev, requires_grad=True); w2 = torch.randn(H, D, device=dev, requires_grad=True)
xs.mark_sharding(w1, mesh, (None, "model")); xs.mark_sharding(w2, mesh, ("model", None))
x = torch.randn(B, D).to(dev); y = torch.randn(B, D).to(dev)
xs.mark_sharding(x, mesh, ("data", None)); xs.mark_sharding(y, mesh, ("data", None))
torch_xla.sync()
loss = ((torch.nn.functional.gelu(x @ w1) @ w2 - y) ** 2).mean()
loss.backward()
with torch.no_grad():
    nw1 = w1 - 1e-3 * w1.grad; nw2 = w2 - 1e-3 * w2.grad
outs = [loss, nw1, nw2]
hlo_text = torch_xla._XLAC._get_xla_tensors_hlo(outs)
open(f"{out}/step.hlo.txt", "w").write(hlo_text)
proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(outs)
open(f"{out}/step.hlo.pb", "wb").write(proto)
shlo = xm.get_stablehlo(outs)
open(f"{out}/step.stablehlo.mlir", "w").write(shlo)
open(f"{out}/step.stablehlo.mlirbc", "wb").write(xm.get_stablehlo_bytecode(outs))
print("hlo text chars", len(hlo_text), "sharding annotations:", hlo_text.count("sharding={"))
print("hlo proto bytes", len(proto))
print("stablehlo chars", len(shlo), "mhlo.sharding:", shlo.count("mhlo.sharding"), "num_partitions attr:", "mhlo.num_partitions" in shlo)
t = time.time(); torch_xla.sync(); xm.wait_device_ops(); print(f"executed on xla-cpu in {time.time()-t:.2f}s; loss", float(loss.item()))
print("dump files:", sorted(os.listdir(f"{out}/dump"))[:40])
