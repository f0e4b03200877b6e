"""``dispatch_batches``: the main data-parallel process reads each global batch and sends
every process its slice (Accelerate's ``DataLoaderDispatcher``).

For streams that cannot shard themselves this reads every sample once in total (instead of
once per process), at the price of moving each batch through the main process. The last
global batch is completed from the first one (``even_batches``) or split as it is; the
loader then reports how many of its rows are real, in rank order, so ``gather_for_metrics``
stays exact.

Example::

    for batch, real in dispatched_batches(global_batches, state, per_process=4):
        ...   # this process's 4 rows of each global batch
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.tree import map_tensors, replace_tensors, tensor_leaves

if TYPE_CHECKING:
    from ..runtime.state import ProcessState

_END = "__slipstream_end_of_data__"


def _rows(batch: Any) -> int:
    rows = [int(t.shape[0]) for t in tensor_leaves(batch) if t.ndim > 0]
    if not rows:
        raise ValueError(
            "dispatch_batches splits each batch along its first dimension, but this batch "
            f"({type(batch).__name__}) holds no tensors; collate samples into tensors"
        )
    return rows[0]


def _take(batch: Any, start: int, stop: int) -> Any:
    return map_tensors(lambda t: t[start:stop] if t.ndim > 0 else t, batch)


def _fill(batch: Any, first: Any, target: int) -> Any:
    """``batch`` extended to ``target`` rows with rows from ``first`` (cycled)."""
    need = target - _rows(batch)
    filled = []
    for value, source in zip(tensor_leaves(batch), tensor_leaves(first), strict=True):
        if value.ndim == 0:
            filled.append(value)
            continue
        repeats = -(-need // source.shape[0])
        extra = torch.cat([source] * repeats)[:need]
        filled.append(torch.cat([value, extra.to(value.device)]))
    return replace_tensors(batch, filled)


def dispatched_batches(
    source: Iterable[Any] | None,
    state: ProcessState,
    *,
    per_process: int,
    even_batches: bool = True,
    drop_last: bool = False,
    slice_fn: Callable[..., Any] | None = None,
) -> Iterator[tuple[Any, int | None]]:
    """``(this process's slice, real rows of the global batch or None)`` for each
    global batch that the main process reads from ``source`` (other processes pass
    ``None``). A collective: every data-parallel process must iterate it. ``slice_fn``
    (Accelerate's ``slice_fn_for_dispatch``) cuts a process's rows instead of slicing
    every tensor: ``slice_fn(batch, slice(start, stop), process_index=, num_processes=)``."""
    from ..runtime.collectives import broadcast_object_list

    world, index = state.num_processes, state.process_index
    size = per_process * world
    reader = iter(source) if source is not None else None
    first: Any = None
    current: Any = next(reader, _END) if reader is not None else None
    while True:
        message: list[Any] = [None]
        if reader is not None:
            upcoming = next(reader, _END) if not (isinstance(current, str)) else _END
            message = [(current, isinstance(upcoming, str))]
            current = upcoming
        broadcast_object_list(message, from_process=0, state=state)
        batch, last = message[0]
        if isinstance(batch, str):
            return
        rows = _rows(batch)
        real: int | None = None
        if rows < size:
            if drop_last:
                return
            real = rows
            if even_batches and first is not None:
                batch = _fill(batch, first, size)
            elif even_batches:
                batch = _fill(batch, batch, size)
        first = batch if first is None else first
        if real is not None and not even_batches:
            share = -(-rows // world)
            start = min(rows, index * share)
            stop = min(rows, start + share)
        else:
            start, stop = index * per_process, (index + 1) * per_process
        if slice_fn is None:
            yield _take(batch, start, stop), real
        else:
            yield (
                slice_fn(batch, slice(start, stop), process_index=index, num_processes=world),
                real,
            )
        if last:
            return
