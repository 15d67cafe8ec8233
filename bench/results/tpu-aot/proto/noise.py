import jax
from jax.experimental import topologies
d = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1", chips_per_host_bounds=(1,1,1)).devices
print("v5e:1x1", d)
