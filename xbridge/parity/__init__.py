"""``xbridge parity``: the tolerance policy and its measures (``policy``), the job (``job``), its typed record
(``record``: parity.json), and the module-by-module search for the first deviation (``divergence``)."""
