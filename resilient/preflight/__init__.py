"""Preflight checks: find the bad node before it costs a restart (``resilient preflight``).

On every rank of the job, within a time budget: the collectives a trainer uses over message sizes
(algorithm and bus bandwidth, nccl-tests' formulas), pairwise send/recv bandwidth (a matrix), host
memory bandwidth with its numpy anchor, host-device copies, the checkpoint URL's throughput and time
to first byte, the c10d store's round trip, and device health (a matmul with a known result, the
vendor's ECC and row-remap counters).  A rank or link worse than the median by a factor is named
and fails the check.  ``Run(preflight=True)`` runs the quick subset before training.

Owns the measurements, the judging and the report; not the launch of a job (``resilient.launch``,
torchrun) nor fault injection (``resilient.chaos``, whose hook the command installs on request).
"""

from resilient.preflight.config import PreflightConfig
from resilient.preflight.outliers import Outlier
from resilient.preflight.report import PreflightReport
from resilient.preflight.runner import preflight_main, run_preflight

__all__ = ["PreflightConfig", "PreflightReport", "Outlier", "run_preflight", "preflight_main"]
