"""Chaos testing: scenarios, fault injectors (an in-rank hook and harness-side signals), the
fault-injecting fsspec filesystem (``faulty://``), launching, verification and reports.

Only the top layer (``resilient.cli``, ``resilient.demo``) and a job that installs ``ChaosHook``
import this package; ``tests/test_imports.py`` keeps it that way."""
