"""torch_xla 2.9, CPU SPMD (4 virtual devices): the Pallas flash attention route (custom_kernel.flash_attention with
partition_spec over the batch), forward + backward, traced only (never executed). torch_xla's trace_pallas lowers the
kernel with jax's default backend (CPU here: 'Only interpret mode is supported'), so it is patched to lower for
platform 'tpu' (jax .trace().lower(lowering_platforms=('tpu',))). Writes the HLO with the tpu_custom_call payloads."""
import os, sys
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tpu_proto/xla_out"
os.environ["PJRT_DEVICE"] = "CPU"; os.environ["CPU_NUM_DEVICES"] = "4"; os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np, torch
import torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
import torch_xla.experimental.custom_kernel as ck
xr.use_spmd()
mode = sys.argv[2] if len(sys.argv) > 2 else "patched"
if mode == "patched":
    import jax
    def trace_pallas_for_tpu(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401
        jax_args, tensor_args = [], []
        for a in args:
            if torch.is_tensor(a):
                jax_args.append(ck.to_jax_shape_dtype_struct(a)); tensor_args.append(a)
            else:
                jax_args.append(a)
        ir = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(
            *jax_args, **kwargs).lower(lowering_platforms=("tpu",)).compiler_ir()
        return ck._extract_backend_config(ir), tensor_args
    ck.trace_pallas = trace_pallas_for_tpu
dev = torch_xla.device()
mesh = xs.Mesh(np.arange(4), (4,), ("data",))
xs.set_global_mesh(mesh)
B, H, S, D = 8, 4, 256, 64
q, k, v = (torch.randn(B, H, S, D).to(dev).requires_grad_() for _ in range(3))
for t in (q, k, v):
    xs.mark_sharding(t, mesh, ("data", None, None, None))
try:
    o = ck.flash_attention(q, k, v, causal=True, sm_scale=D ** -0.5, partition_spec=("data", None, None, None), mesh=mesh)
    loss = (o.float() ** 2).sum()
    loss.backward()
    outs = [loss, q.grad, k.grad, v.grad]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(outs)
    path = f"{out}/flash_{mode}.hlo.txt"
    open(path, "w").write(hlo)
    print(f"{mode}: HLO {len(hlo)} chars, tpu_custom_call x{hlo.count('tpu_custom_call')}, "
          f"manual sharding x{hlo.count('sharding={manual}')}, SPMDFullToShardShape x{hlo.count('SPMDFullToShardShape')} -> {path}")
except Exception as e:
    print(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
