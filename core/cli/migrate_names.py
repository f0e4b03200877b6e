"""What slipstream provides of Accelerate's names, decided by importing slipstream's modules
now (names are being added; a hard-coded list would go stale), for ``slipstream migrate``:
where ``from accelerate.X import name`` goes, what the compatibility table says about it,
keywords a call passes that slipstream's function does not take, ``Accelerator`` members.

Example::

    provider("accelerate.data_loader", "prepare_data_loader")  # 'slipstream.data'
    name_findings("accelerate.utils", "MegatronLMDummyScheduler", None)
    # ['`MegatronLMDummyScheduler` (accelerate.utils) is not provided by slipstream: ...']
"""

from __future__ import annotations

import importlib
import inspect
import types
from functools import cache
from typing import Any

#: Accelerate's modules (and their submodules) -> the slipstream modules that may provide their
#: names, tried in order; a module not listed here is looked for in :data:`OTHER_MODULES`.
MODULES: dict[str, tuple[str, ...]] = {
    "accelerate": ("slipstream",),
    "accelerate.utils": ("slipstream.utils",),
    "accelerate.logging": ("slipstream.logging",),
    "accelerate.state": ("slipstream",),
    "accelerate.accelerator": ("slipstream",),
    "accelerate.data_loader": ("slipstream.data", "slipstream"),
    "accelerate.test_utils": ("slipstream.test_utils",),
    "accelerate.tracking": ("slipstream.tracking", "slipstream.utils"),
    "accelerate.commands": (),
    "accelerate.commands.merge": ("slipstream.cli.merge_weights",),
    "accelerate.commands.launch": ("slipstream.cli.launch",),
    "accelerate.commands.config": ("slipstream.cli.configure",),
    "accelerate.commands.env": ("slipstream.cli.environment",),
    "accelerate.commands.estimate": ("slipstream.cli.estimate_memory",),
}
OTHER_MODULES = ("slipstream", "slipstream.utils")


def is_accelerate(module: str) -> bool:
    return module == "accelerate" or module.startswith("accelerate.")


def candidates(module: str) -> tuple[str, ...]:
    """The slipstream modules that may hold the names of Accelerate's ``module``: those of its
    longest listed prefix (``accelerate.utils.operations`` -> ``accelerate.utils``)."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        prefix = ".".join(parts[:end])
        if prefix in MODULES:
            return MODULES[prefix]
    return MODULES["accelerate"] if module == "accelerate" else OTHER_MODULES


@cache
def load(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def declares(module: Any, name: str) -> bool:
    """Whether ``module`` (or a class) has ``name``: an attribute, or a submodule not
    imported yet (``slipstream.utils`` before anything imported it)."""
    try:
        getattr(module, name)
    except AttributeError:
        is_package = isinstance(module, types.ModuleType) and hasattr(module, "__path__")
        return is_package and load(f"{module.__name__}.{name}") is not None
    except Exception:  # declared, but needs an optional dependency this machine lacks
        return True
    return True


@cache
def provider(module: str, name: str) -> str | None:
    """The slipstream module ``from accelerate.X import name`` becomes, decided by what
    slipstream provides now (imported and looked up), or None when it lacks ``name``.

    Example::

        provider("accelerate.data_loader", "prepare_data_loader")  # 'slipstream.data'
        provider("accelerate.test_utils", "RegressionModel")      # None
    """
    for target in candidates(module):
        loaded = load(target)
        if loaded is not None and declares(loaded, name):
            return target
    return None


def counterpart(module: str) -> str | None:
    """The slipstream module ``import accelerate.X`` becomes, if there is one."""
    return next((target for target in candidates(module) if load(target) is not None), None)


def _table_row(module: str, name: str) -> tuple[str, Any] | None:
    """``(namespace, row)`` of the compatibility table for ``name`` of Accelerate's ``module``
    (a submodule's names are looked up where Accelerate exports them too)."""
    from ..compatibility import lookup

    if module == "accelerate.logging":
        namespaces: tuple[str, ...] = ("accelerate.logging",)
    elif module == "accelerate.utils" or module.startswith("accelerate.utils."):
        namespaces = ("accelerate.utils", "accelerate")
    else:
        namespaces = ("accelerate", "accelerate.utils")
    for namespace in namespaces:
        row = lookup(namespace, name)
        if row is not None:
            return namespace, row
    return None


def name_findings(module: str, name: str, target: str | None) -> list[str]:
    """What to tell about ``from module import name`` going to ``target`` (None: kept on
    accelerate): nothing when slipstream provides it the same."""
    from ..compatibility import DIFFERENT

    found = _table_row(module, name)
    where = f"`{name}` ({module})"
    if target is None:
        why = f": {found[1].note}" if found and found[1].note else ""
        unlisted = "" if found else " (no row in the compatibility table)"
        return [f"{where} is not provided by slipstream{unlisted}{why}; kept on accelerate"]
    if found is None:
        return [
            f"{where} has no row in the compatibility table: {target}.{name} is used; check it "
            "does what Accelerate's does"
        ]
    if found[1].status == DIFFERENT:
        return [f"{where} is provided differently by {target}: {found[1].note}"]
    return []


def unknown_keywords(function: Any, keywords: list[str]) -> list[str]:
    """The ``keywords`` a call passes that ``function`` (or class) does not take."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    accepted = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [k for k in keywords if k not in accepted]


@cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """Names the methods of ``cls`` (and its bases) assign on ``self``: members an instance
    has that the class itself does not (``accelerator.state``)."""
    import ast

    names: set[str] = set()
    for klass in cls.__mro__:
        try:
            tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # a builtin, or source not shipped
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return frozenset(names)


def member_findings(member: str) -> tuple[str, str] | None:
    """``(status, message)`` about ``accelerator.member``, or None when slipstream's
    Accelerator has it the same; the status is one of the compatibility table's."""
    from ..compatibility import DIFFERENT, NOT_PROVIDED, lookup

    row = lookup("Accelerator", member)
    accelerator = getattr(load("slipstream"), "Accelerator", None)
    has = accelerator is not None and (
        declares(accelerator, member) or member in _instance_attributes(accelerator)
    )
    where = f"`{member}` (Accelerator)"
    if not has:
        why = f": {row.note}" if row is not None and row.note else " (no row in the table)"
        return NOT_PROVIDED, f"{where} is not provided by slipstream{why}"
    if row is None:
        return DIFFERENT, f"{where} has no row in the compatibility table: check slipstream's"
    if row.status == DIFFERENT:
        return DIFFERENT, f"{where} is provided differently: {row.note}"
    return None
