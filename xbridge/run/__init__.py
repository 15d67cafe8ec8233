"""Running a program: the run loop (``loop``: resume, checkpoints, the record; ``prepare``: everything before the
first step; ``steps``: the step loop; ``summary``: the record's computed parts), what it produces (``record``) and
the per-target subprocess that compare and parity share (``isolated``). Checkpoints are xbridge.checkpoint, the
processes of a job xbridge.processes."""
