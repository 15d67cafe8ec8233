"""``xbridge parity``: the tolerance policy and its measures (``policy``), the job (``job``), and the module-by-
module search for the first deviation (``divergence``)."""
