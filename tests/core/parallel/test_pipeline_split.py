"""Splitting a batch into micro-batches (core/parallel/pipeline/runtime.py): the fast path
for positional plain tensors gives what torch's split gives, and everything else goes to
torch's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from slipstream.parallel.pipeline.runtime import _SplitPlainTensors

MICROBATCHES = 4


def _splitter() -> tuple[_SplitPlainTensors, list[Any]]:
    calls: list[Any] = []

    def torch_split(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        calls.append(args)  # (what it returns is torch's business)

    schedule = SimpleNamespace(_split_inputs=torch_split, _args_chunk_spec=None)
    return _SplitPlainTensors(schedule, MICROBATCHES), calls


def _same(ours: Any, theirs: Any) -> bool:
    """The same micro-batches: equal values, and views of the same memory."""
    if isinstance(ours, torch.Tensor):
        return (
            torch.equal(ours, theirs)
            and ours.data_ptr() == theirs.data_ptr()
            and ours.stride() == theirs.stride()
        )
    if isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(
            _same(a, b) for a, b in zip(ours, theirs, strict=True)
        )
    return bool(ours == theirs)


def test_plain_tensors_split_as_torch_splits_them():
    split, calls = _splitter()
    tokens = torch.arange(10 * 3).reshape(10, 3)  # 10 does not divide by 4: 3, 3, 2, 2
    features = torch.randn(10, 2, 5, dtype=torch.float64)
    ours = split((tokens, features), {})
    assert calls == []  # the fast path
    theirs = split_args_kwargs_into_chunks((tokens, features), {}, MICROBATCHES)
    assert _same(ours[0], theirs[0]) and ours[1] == theirs[1] == [{}] * MICROBATCHES
    assert [chunk[0].shape[0] for chunk in ours[0]] == [3, 3, 2, 2]


def test_anything_else_goes_to_torchs_split():
    split, calls = _splitter()
    batch = torch.randn(8, 3)
    leaf = torch.randn(8, 3, requires_grad=True)  # torch keeps its micro-batches' .grad
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((batch,), {"mask": batch}),
        ((batch, 2.0), {}),
        ((leaf,), {}),
        ((torch.tensor(1.0),), {}),
        ((), {}),
    ]
    for args, kwargs in cases:
        calls.clear()
        split(args, kwargs)
        assert calls == [args], args
