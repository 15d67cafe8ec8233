import jax
try:
    jax.devices("tpu")
except RuntimeError as e:
    print("jax.devices('tpu') ->", str(e).splitlines()[0])
from jax._src import hardware_utils
print("num_available_tpu_chips_and_device_id:", hardware_utils.num_available_tpu_chips_and_device_id())
