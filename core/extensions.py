"""Extension point: other packages teach ``Accelerator.prepare`` new kinds of objects.

A preparer has ``matches(obj) -> bool`` and ``prepare(obj, accelerator) -> obj``. Preparers
are registered with :func:`register_preparer`, or found through the ``slipstream.preparers``
entry-point group (how ``slipstream.integrations.torchmetrics`` makes
``accelerator.prepare(metric)`` work) — the core never imports an integration by name.

Example::

    class MyPreparer:
        @staticmethod
        def matches(obj): return isinstance(obj, MyThing)
        @staticmethod
        def prepare(obj, accelerator): return obj.to(accelerator.device)

    register_preparer(MyPreparer)
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Protocol


class Preparer(Protocol):
    def matches(self, obj: Any) -> bool: ...

    def prepare(self, obj: Any, accelerator: Any) -> Any: ...


_registered: list[Preparer] = []
_entry_points_loaded = False


def register_preparer(preparer: Preparer) -> None:
    """Make ``Accelerator.prepare`` hand matching objects to ``preparer``."""
    _registered.append(preparer)


def preparers() -> list[Preparer]:
    """Registered preparers, loading the ``slipstream.preparers`` entry points once."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in importlib.metadata.entry_points(group="slipstream.preparers"):
            try:
                _registered.append(entry.load())
            except ImportError:
                continue  # its optional dependency is not installed
    return list(_registered)


def find_preparer(obj: Any) -> Preparer | None:
    for preparer in preparers():
        if preparer.matches(obj):
            return preparer
    return None
