"""What the torch-based backends (eager, inductor, xla) share: the train step in PyTorch (``train``), the module-
output recorder behind ``--trace-modules`` (``module_outputs``) and the base class of backends that run on torch's
own devices (``device``). Backend-specific code stays in each backend's folder."""
