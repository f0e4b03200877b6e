"""Collective safety: matching calls checked in debug mode, clear errors otherwise.

Switched on by ``slipstream launch --debug``, ``SLIPSTREAM_DEBUG=1`` or
``Accelerator(debug=True)``. Each collective first exchanges a small description of what
each rank passed; when they disagree every rank raises the same
:class:`CollectiveMismatchError` listing what each rank passed, instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from .state import ProcessState
from .tree import describe

F = TypeVar("F", bound=Callable[..., Any])

_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "failed to recv, got 0 bytes",
)


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with incompatible data."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than the process-group timeout for the other ranks."""


class PeerProcessFailedError(RuntimeError):
    """Another process of the job went away while this one waited for it."""


@contextlib.contextmanager
def guarded(operation: str, rank: int) -> Iterator[None]:
    """Turn torch's low-level timeout / lost-peer errors into ones that say what to do."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if "Timed out" in text or "timed out" in text or "Timeout" in text:
            raise CollectiveTimeoutError(
                f"collective '{operation}' on process {rank} timed out waiting for the other "
                "processes. Usually one process skipped this call or called another collective; "
                "rerun with `slipstream launch --debug` (or SLIPSTREAM_DEBUG=1) to see which "
                f"process passed what. ({text.strip()[:200]})"
            ) from error
        if any(marker in text for marker in _PEER_GONE):
            raise PeerProcessFailedError(
                f"collective '{operation}' on process {rank} lost its peers: another process "
                f"stopped (look for its traceback). ({text.strip()[:200]})"
            ) from error
        raise


def collective(operation: str) -> Callable[[F], F]:
    """Decorator for collectives taking ``state=``: errors are made clear (see guarded)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from .state import current_state

            state = kwargs.get("state") or current_state()
            with guarded(operation, state.process_index):
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
