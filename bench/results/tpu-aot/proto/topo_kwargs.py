import jax
from jax.experimental import topologies
def show(name, **kw):
    try:
        d = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices
        print("OK ", name, kw, "n=", len(d), "kind=", d[0].device_kind, "hosts=", len({x.process_index for x in d}),
              "slices=", sorted({getattr(x, 'slice_index', None) for x in d}, key=str), "num_cores=", getattr(d[0], 'num_cores', None),
              [repr(x) for x in d[:3]])
    except Exception as e:
        print("ERR", name, kw, type(e).__name__, str(e)[:300])
show("v4:2x2x1")
show("v4:2x2x1", chip_config_name="megacore")
show("v4:2x2x1", chip_config_name="default")
show("v4:2x2x1", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
show("v5p:2x2x1", chip_config_name="default")
show("v5:2x2x1", chip_config_name="megacore")
show("v5p:4x4x4", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), wrap=(True, True, True))
show("v5e:2x4", chip_config_name="default", chips_per_host_bounds=(2, 2, 1))
show("v5e:2x4", chips_per_host_bounds=(2, 4, 1))
show("v5e:2x2", num_slices=2)
show("v6e:16x16", wrap=(True, True, False))
show("v6e:1x1")
show("v5e:1x1")
show("v5litepod:2x2")
show("v6e:2x4", chip_config_name="megacore")
show("v3:2x2")
show("v2:2x2")
show("v5e:3x3")
