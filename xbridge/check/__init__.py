"""``xbridge check``: where a program will run and why not, before anything runs (job.py, record.py)."""
