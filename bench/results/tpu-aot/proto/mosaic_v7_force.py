import os, sys
sys.argv = [sys.argv[0], "none"]
from jax._src import tpu_custom_call
tpu_custom_call.get_ir_version = lambda ctx: int(os.environ["IRV"])
exec(open("/tmp/tpu_proto/mosaic_v7.py").read().replace('mode = sys.argv[1] if len(sys.argv) > 1 else "patch"', 'mode = "forced"'))
