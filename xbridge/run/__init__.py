"""Running a program: the run loop (``loop``), what it produces (``record``), checkpoints (``checkpoint``) and the
per-target subprocess that compare and parity share (``isolated``)."""
