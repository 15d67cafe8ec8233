"""Does torch_xla's TPU-only lowering (CheckTpuDevice: SPMD device + PJRT_DEVICE=='TPU') change the HLO of a CPU trace?
torch.gather lowers through TorchGather(sparse=IsSparseGather(...)): dense on TPU below 81920 rows, sparse elsewhere."""
import os
os.environ["PJRT_DEVICE"] = "CPU"; os.environ["CPU_NUM_DEVICES"] = "4"
import numpy as np, torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
xr.use_spmd()
dev = torch_xla.device()
x = torch.randn(16, 1000).to(dev); idx = torch.randint(0, 1000, (16, 1)).to(dev)
def hlo():
    y = torch.gather(x, 1, idx).sum()
    emb = torch.nn.functional.embedding(idx.squeeze(1), x).sum()
    ce = torch.nn.functional.cross_entropy(x, idx.squeeze(1))
    return torch_xla._XLAC._get_xla_tensors_hlo([y, emb, ce])
import re
def ops(t): return {k: len(re.findall(r"\b" + k + r"\(", t)) for k in ("gather", "compare", "select", "dot", "iota")}
a = hlo(); print("PJRT_DEVICE=CPU :", ops(a))
os.environ["PJRT_DEVICE"] = "TPU"
b = hlo(); print("PJRT_DEVICE=TPU (flipped after start):", ops(b))
