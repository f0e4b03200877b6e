"""Package faces that import a name's module on first use, so ``import slipstream`` costs
about as much as ``import torch`` (benchmarks/startup.py) however many names it offers.

Example::

    # in a package's __init__.py
    __getattr__, __dir__ = lazy_exports(__name__, {"gather": "runtime.collectives"}, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def import_export(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any], name: str
) -> Any:
    """The value of ``package``'s public ``name``: imported from its module in ``exports``
    (relative to ``package``) and kept in ``namespace`` so later lookups cost nothing."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", package), name)
    namespace[name] = value
    return value


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` (``namespace`` is its
    ``globals()``): each name in ``exports`` is imported on first use."""

    def get(name: str) -> Any:
        return import_export(package, exports, namespace, name)

    def names() -> list[str]:
        return sorted([*namespace, *exports])

    return get, names
