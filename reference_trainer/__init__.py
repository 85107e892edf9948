"""The reference MoE trainer (tensor, expert and data parallel, ZeRO-1) that uses resilient end to
end: ``python -m reference_trainer`` (reference_trainer/__main__.py has its flags)."""

# What a rank imports (``reference_trainer.train`` is most of it): a node's fork server
# (resilient/forkserver.py) imports these once, and every rank it forks starts with them loaded.
PRELOAD = ("reference_trainer.train", "fsspec.implementations.local", "numpy.random")
