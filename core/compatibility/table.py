"""The table's shape: a :class:`Row` per name and namespace, and the helpers that fill it
(the rows themselves are in :mod:`slipstream.compatibility.names`)."""

from __future__ import annotations

from dataclasses import dataclass

SAME, DIFFERENT, NOT_PROVIDED = "same", "different", "not provided"
#: The namespaces of the table, in the order the document lists them.
NAMESPACES = ("accelerate", "accelerate.utils", "accelerate.logging", "Accelerator")


@dataclass(frozen=True)
class Row:
    status: str
    note: str = ""


TOP, UTILS, LOGGING, ACCELERATOR = NAMESPACES

#: namespace -> name -> row, filled in by :mod:`slipstream.compatibility.names`.
TABLE: dict[str, dict[str, Row]] = {namespace: {} for namespace in NAMESPACES}


def add(namespaces: str | tuple[str, ...], status: str, names: str, note: str = "") -> None:
    """Give each of the whitespace-separated ``names`` a row in ``namespaces``."""
    for namespace in (namespaces,) if isinstance(namespaces, str) else namespaces:
        for name in names.split():
            if name in TABLE[namespace]:
                raise ValueError(f"two rows for {name!r} in {namespace}")
            TABLE[namespace][name] = Row(status, note)


def add_each(namespace: str, status: str, notes: dict[str, str]) -> None:
    """One row per name of ``notes``, with its note."""
    for name, note in notes.items():
        add(namespace, status, name, note)


def lookup(namespace: str, name: str) -> Row | None:
    """The row of ``name`` in ``namespace`` (``None`` when the table has none)."""
    return TABLE.get(namespace, {}).get(name)
