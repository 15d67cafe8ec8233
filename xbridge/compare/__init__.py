"""``xbridge compare``: the job (``job``), its options (``options``) and typed record (``record``: results.json),
model FLOPs (``flops``), device peaks for MFU (``peaks``), plots (``plots``) and report.md (``report``)."""
