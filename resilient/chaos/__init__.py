"""Chaos testing: fault injectors.  So far: the fault-injecting fsspec filesystem (faultfs)."""
