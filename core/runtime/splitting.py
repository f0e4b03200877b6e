"""Give each process its share of a list, tuple, dict of sequences, tensor or
``datasets.Dataset``.

Example::

    with accelerator.split_between_processes(prompts) as mine:
        results = [generate(p) for p in mine]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch


def _bounds(length: int, index: int, count: int) -> tuple[int, int]:
    per, extra = divmod(length, count)
    start = index * per + min(index, extra)
    return start, start + per + (1 if index < extra else 0)


def _pad(part: Any, target: int, whole: Any) -> Any:
    missing = target - len(part)
    if missing <= 0 or len(whole) == 0:
        return part
    last = whole[-1:]
    if isinstance(part, torch.Tensor):
        return torch.cat([part, *([last] * missing)])
    return part + type(part)(last) * missing


def split_sequence(
    inputs: Any, process_index: int, num_processes: int, apply_padding: bool = False
) -> Any:
    """This process's contiguous share; earlier processes get one more item when uneven.

    With ``apply_padding`` every share has the same length, padded by repeating the last
    item of the input (so results can be gathered; drop the extras afterwards).
    """
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes needs all values of a dict to have the same length; "
                f"got lengths {sorted(lengths)}"
            )
        return type(inputs)(  # type: ignore[call-arg]
            {
                k: split_sequence(v, process_index, num_processes, apply_padding)
                for k, v in inputs.items()
            }
        )
    select = getattr(inputs, "select", None)
    if callable(select) and not isinstance(inputs, (Sequence, torch.Tensor)):
        # A datasets.Dataset (not imported here): its rows by index, padded with the last.
        start, stop = _bounds(len(inputs), process_index, num_processes)
        rows = list(range(start, stop))
        if apply_padding and len(inputs):
            rows += [len(inputs) - 1] * (-(-len(inputs) // num_processes) - len(rows))
        return select(rows)
    if not isinstance(inputs, (Sequence, torch.Tensor)) or isinstance(inputs, (str, bytes)):
        raise TypeError(
            "split_between_processes takes a list, tuple, dict of sequences, a tensor or a "
            f"datasets.Dataset; got {type(inputs).__name__}"
        )
    start, stop = _bounds(len(inputs), process_index, num_processes)
    part = inputs[start:stop]
    if apply_padding:
        part = _pad(part, -(-len(inputs) // num_processes), inputs)
    return part


@contextlib.contextmanager
def split_between_processes(
    inputs: Any, process_index: int, num_processes: int, apply_padding: bool = False
) -> Iterator[Any]:
    """Context-manager form of :func:`split_sequence`."""
    yield split_sequence(inputs, process_index, num_processes, apply_padding)
