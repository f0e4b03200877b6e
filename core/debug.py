"""Debug mode: check that every rank calls the same collective with compatible data.

Switched on by ``slipstream launch --debug``, ``SLIPSTREAM_DEBUG=1`` or
``Accelerator(debug=True)``. Each collective first exchanges a small description of what
each rank passed; when they disagree every rank raises the same
:class:`CollectiveMismatchError` listing what each rank passed, instead of hanging.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .state import ProcessState
from .tree import describe


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with incompatible data."""


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
    dist.all_gather_object(everyone, {"key": mine, "shown": summary})
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
