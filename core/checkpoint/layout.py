"""Which processes of a save write into the same checkpoint folder.

Usually every process gets the same path on a filesystem they all share, and the main
process commits the one folder. But a process may be given its own folder (Accelerate's
scripts pass ``save_state(f"ckpt_{rank}")``), or machines may each have a local disk and
the same path string names a different folder on each. :func:`discover_layout` finds out
by writing: every process puts a small probe file beside its target and looks for the
probes of the lower processes given the same path string; the first one it can see owns
its folder (the owner writes the files every process shares and commits the folder).

Example::

    layout = discover_layout(location, state)     # collective
    if layout.is_owner(state.process_index):
        prepare_target(location)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..runtime import collectives
from ..runtime.state import ProcessState
from .commit import CheckpointError, Location, automatic_checkpoints
from .storage import Storage

T = TypeVar("T")


@dataclass(frozen=True)
class FolderLayout:
    """``owners[rank]``: the process owning the folder ``rank`` writes into; ``targets``:
    each process's target as it named it."""

    owners: tuple[int, ...]
    targets: tuple[str, ...]

    @property
    def shared(self) -> bool:
        """One folder for all processes (the usual case)."""
        return all(owner == 0 for owner in self.owners)

    def is_owner(self, rank: int) -> bool:
        return self.owners[rank] == rank

    def members(self, rank: int) -> list[int]:
        """The processes writing into the same folder as ``rank``."""
        return [r for r, owner in enumerate(self.owners) if owner == self.owners[rank]]

    def describe(self) -> str:
        """e.g. ``/ckpt on processes 0-3; /ckpt (another copy) on processes 4-7``."""
        seen: dict[str, int] = {}
        parts = []
        for owner in sorted(set(self.owners)):
            target = self.targets[owner]
            copy = " (another folder at the same path)" if target in seen else ""
            seen[target] = owner
            parts.append(f"{target}{copy} on processes {_ranges(self.members(owner))}")
        return "; ".join(parts)


def single_layout(target: str) -> FolderLayout:
    return FolderLayout((0,), (target,))


def discover_layout(location: Location, state: ProcessState) -> FolderLayout:
    """Find which processes share ``location``'s folder (collective; every process passes
    its own location, all with the same token). Raises :class:`CheckpointError` on every
    process when probing fails anywhere or the processes disagree."""
    storage, rank = location.storage, state.process_index
    target = storage.url(location.path)
    if state.num_processes == 1:
        return single_layout(target)
    targets = tuple(collectives.gather_object([target], state=state))
    probe = location.sibling("probe")
    everyone(state, lambda: storage.write_bytes(storage.join(probe, str(rank)), b""))

    def first_visible() -> int:
        # Every process checks the lower processes of its path in the same (ascending)
        # order, so all processes of one folder stop at the same, lowest one. Checking
        # names one by one (not listing the folder) avoids cached directory listings.
        for other in range(rank):
            if targets[other] == target and storage.exists(storage.join(probe, str(other))):
                return other
        return rank

    owners = tuple(gathered(state, first_visible))
    layout = FolderLayout(owners, targets)
    # After the gather every process has looked: owners remove the probes of their folder.
    everyone(state, lambda: storage.remove(probe) if layout.is_owner(rank) else None)
    confused = [r for r, owner in enumerate(owners) if owners[owner] != owner]
    if confused:
        raise CheckpointError(
            f"the processes disagree about which of them share a checkpoint folder (process "
            f"{confused[0]} sees the files of process {owners[confused[0]]}, which sees those "
            f"of process {owners[owners[confused[0]]]}): {layout.describe()}"
        )
    return layout


def everyone(state: ProcessState, action: Callable[[], T]) -> T:
    """Run ``action`` on every process; if it fails on any process, raise
    :class:`CheckpointError` on all of them (one process raising alone would leave the
    others waiting in the next collective). With one process the error itself is raised."""
    return _run(state, action, share=False)[0]


def gathered(state: ProcessState, action: Callable[[], T]) -> list[T]:
    """:func:`everyone`, returning every process's (small, picklable) result."""
    return _run(state, action, share=True)


def _run(state: ProcessState, action: Callable[[], T], share: bool) -> list[T]:
    result: Any = None
    error: str | None = None
    try:
        result = action()
    except Exception as exc:
        if state.num_processes == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    outcomes = collectives.gather_object([(result if share else None, error)], state=state)
    failed = [(rank, e) for rank, (_, e) in enumerate(outcomes) if e is not None]
    if failed:
        raise CheckpointError("; ".join(f"process {rank}: {e}" for rank, e in failed))
    return [value for value, _ in outcomes] if share else [result]


def newest_everywhere(storage: Storage, state: ProcessState) -> int | None:
    """The number of the newest ``checkpoint_N`` complete in every process's ``storage``
    folder (collective; the folders may differ), ``None`` when there is none anywhere."""

    def complete() -> list[int]:
        if not storage.exists(storage.root):
            return []
        return [number for number, _ in automatic_checkpoints(storage, storage.root)]

    found = [set(numbers) for numbers in gathered(state, complete)]
    common = set.intersection(*found)
    if not common:
        if any(found):
            raise CheckpointError(
                f"no checkpoint_N is complete in every process's folder "
                f"{storage.url(storage.root)} (complete ones: "
                + ", ".join(f"process {r}: {sorted(n)}" for r, n in enumerate(found))
                + "); the processes do not share one folder and their saves diverged"
            )
        return None
    newest = max(common)
    if newest < max(set.union(*found)):
        warnings.warn(
            f"checkpoint_{max(set.union(*found))} is not complete in every process's folder; "
            f"loading checkpoint_{newest}, the newest that is",
            stacklevel=4,
        )
    return newest


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
