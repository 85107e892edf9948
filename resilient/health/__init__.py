"""Failure detection: heartbeats through the c10d store, a leader that issues verdicts, an event log."""

from resilient.health.detector import Detector, DetectorConfig, Finding, RankStatus, Verdict
from resilient.health.events import EventLog
from resilient.health.heartbeat import EXIT_RANK_FAILURE, Monitor

__all__ = [
    "Detector",
    "DetectorConfig",
    "Finding",
    "RankStatus",
    "Verdict",
    "EventLog",
    "Monitor",
    "EXIT_RANK_FAILURE",
]
