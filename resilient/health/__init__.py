"""Failure detection: heartbeats through the c10d store, a leader that issues verdicts, an event log."""

from resilient.health.detector import (
    DEFAULT_PHASE_BUDGETS_S,
    Detector,
    DetectorConfig,
    Finding,
    RankStatus,
    Verdict,
)
from resilient.health.events import EventLog, default_event_log
from resilient.health.heartbeat import EXIT_RANK_FAILURE, Monitor

__all__ = [
    "Detector",
    "DetectorConfig",
    "DEFAULT_PHASE_BUDGETS_S",
    "Finding",
    "RankStatus",
    "Verdict",
    "EventLog",
    "default_event_log",
    "Monitor",
    "EXIT_RANK_FAILURE",
]
