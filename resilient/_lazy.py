"""The package ``__init__``s' names, imported when first used (PEP 562), one import at a time.

Two threads importing different parts of torch at once can abort the process (torch's own imports
are not safe against that), so every lazy import takes one reentrant lock (one lazy import may
resolve another)."""

from __future__ import annotations

import importlib
import threading

TYPE_CHECKING = False  # (not typing's: a process that starts often, a stand-in, never imports it)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

IMPORT_LOCK = threading.RLock()


def name_of(module: str, name: str) -> Any:
    """``module``'s ``name``, importing the module under the lock."""
    with IMPORT_LOCK:
        return getattr(importlib.import_module(module), name)


def submodule(package: str, name: str) -> ModuleType | None:
    """``package.name`` imported under the lock, or None when there is no such module."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    with IMPORT_LOCK:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            return None
