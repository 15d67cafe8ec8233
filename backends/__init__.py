"""Backend plugins shipped with xbridge, installed as ``xbridge.backends.*``."""
