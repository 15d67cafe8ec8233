"""``xbridge compare``: the job (``job``), model FLOPs (``flops``), device peaks for MFU (``peaks``), plots."""
