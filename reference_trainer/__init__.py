"""The reference MoE trainer (tensor, expert and data parallel, ZeRO-1).

Not built yet: see the trainer issue.  It will import ``resilient`` and ``reshape`` like any user.
"""
