"""Offline topology resharding of resilient checkpoints, and the ``reshape`` CLI.

Imports only ``resilient.layout``, ``resilient.checkpoint`` and ``resilient.errors``.
"""
