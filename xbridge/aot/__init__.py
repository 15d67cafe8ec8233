"""Ahead-of-time compilation for hardware this machine does not have: ``xbridge compile`` lowers exactly the
programs ``run`` would build for a TPU slice (train step, evaluation, initialisation) and compiles them with the
real TPU compiler (libtpu's compile-only client), on any machine; per chip it reports memory against HBM, XLA's
cost analysis, the collectives, a roofline bound on the step time and the compile time.

framework-free: the topology names (topology.py), the chips' datasheet figures (chips.py), the records and the
arithmetic on them (record.py), the process setup for libtpu (environment.py) and the HLO text reading
(hlo.py). A backend compiles through the :class:`xbridge.contract.capabilities.AheadOfTime` capability."""
