"""Collective safety: matching calls checked in debug mode, clear errors otherwise
(the errors themselves live in :mod:`slipstream.runtime.errors`).

Switched on by ``slipstream launch --debug``, ``SLIPSTREAM_DEBUG=1`` or
``Accelerator(debug=True)``. Each collective first exchanges a small description of what
each rank passed; when they disagree every rank raises the same
:class:`CollectiveMismatchError` listing what each rank passed, instead of hanging.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import CollectiveMismatchError, guarded
from .state import ProcessState, current_state
from .tree import describe

F = TypeVar("F", bound=Callable[..., Any])


def collective(operation: str) -> Callable[[F], F]:
    """Decorator for collectives taking ``state=``: errors are made clear (see guarded)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = kwargs.get("state") or current_state()
            group = tuple(state.global_ranks) if state.global_ranks is not None else None
            with guarded(operation, state.process_index, args[0] if args else None, group):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _drop_dim(summary: Any, dim: int) -> Any:
    if isinstance(summary, tuple) and summary and summary[0] == "Tensor":
        shape = list(summary[1])
        if shape:
            shape[dim] = "*"
        return ("Tensor", tuple(shape), summary[2])
    if isinstance(summary, dict):
        return {k: _drop_dim(v, dim) for k, v in summary.items()}
    if isinstance(summary, list):
        return [_drop_dim(v, dim) for v in summary]
    return summary


def verify_collective(
    state: ProcessState,
    operation: str,
    data: Any = None,
    *,
    free_dim: int | None = None,
    compare_data: bool = True,
    **options: Any,
) -> None:
    """Raise the same error on every rank unless all ranks agree on ``operation``.

    ``free_dim`` names a tensor dimension allowed to differ (``pad_across_processes``);
    ``compare_data=False`` compares only the operation and options (object collectives).
    """
    if not state.debug or state.num_processes == 1:
        return
    summary = describe(data) if compare_data else None
    comparable = _drop_dim(summary, free_dim) if free_dim is not None else summary
    mine = {"operation": operation, "options": options, "data": comparable}
    everyone: list[Any] = [None] * state.num_processes
    dist.all_gather_object(everyone, {"key": mine, "shown": summary}, group=state.group)
    if all(entry["key"] == everyone[0]["key"] for entry in everyone):
        return
    lines = [
        f"  rank {rank}: {entry['key']['operation']}({entry['shown']!r}"
        + (f", {entry['key']['options']}" if entry["key"]["options"] else "")
        + ")"
        for rank, entry in enumerate(everyone)
    ]
    operations = {entry["key"]["operation"] for entry in everyone}
    headline = (
        f"ranks called different collectives ({', '.join(sorted(operations))})"
        if len(operations) > 1
        else f"ranks passed incompatible data to collective '{operation}'"
    )
    raise CollectiveMismatchError(
        f"{headline} (debug-mode check); every rank must call the same collective with "
        "tensors of the same shape and dtype:\n" + "\n".join(lines)
    )
