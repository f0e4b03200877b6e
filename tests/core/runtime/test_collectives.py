"""Collectives on 2 real CPU processes over gloo, and their single-process behaviour."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream import (
    Accelerator,
    CollectiveMismatchError,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from slipstream.runtime.collectives import gather_uneven as collectives_gather_uneven
from tests.distributed import run_distributed

Pair = namedtuple("Pair", "left right")


def _tensor_collectives() -> dict:
    acc = Accelerator()
    rank = acc.process_index
    out = {}
    data = {
        "a": torch.tensor([rank, rank + 10]),
        "b": [Pair(torch.full((1, 2), float(rank)), torch.tensor([rank]))],
    }
    gathered = gather(data)
    out["gather_a"] = gathered["a"].tolist()
    out["gather_b"] = gathered["b"][0].left.tolist()
    out["gather_b_tag"] = gathered["b"][0].right.tolist()
    try:
        gather({"a": torch.ones(1), "name": "x"})
    except TypeError as error:
        out["mixed"] = str(error)
    out["empty_uneven"] = list(collectives_gather_uneven(torch.zeros(0, 2)).shape)
    out["gather_scalar"] = gather(torch.tensor(rank * 2.0)).tolist()
    out["reduce_sum"] = reduce(torch.tensor([1.0, rank]), "sum").tolist()
    out["reduce_mean"] = reduce(torch.tensor([1.0, rank]), "mean").tolist()
    out["reduce_scaled"] = acc.reduce(torch.tensor([2.0]), "sum", scale=0.5).tolist()
    out["reduce_max"] = reduce(torch.tensor([float(rank), -rank]), "max").tolist()
    out["reduce_min"] = reduce(torch.tensor([float(rank), -rank]), "min").tolist()
    own = torch.tensor([rank, rank])
    broadcast(own, from_process=1)
    out["broadcast"] = own.tolist()
    out["objects"] = gather_object([f"r{rank}", rank])
    out["object"] = gather_object({"rank": rank})
    items = [rank, None] if rank == 0 else [None, None]
    out["broadcast_objects"] = broadcast_object_list(items, from_process=0)
    ragged = torch.arange(rank + 2).view(1, -1)  # lengths 2 and 3 along dim 1
    padded = pad_across_processes(ragged, dim=1, pad_index=-1)
    out["pad_end"] = padded.tolist()
    out["pad_first"] = acc.pad_across_processes(
        ragged, dim=1, pad_index=-1, pad_first=True
    ).tolist()
    out["pad_then_gather"] = acc.gather(padded).tolist()
    return out


def test_tensor_and_object_collectives_on_two_processes():
    r0, r1 = run_distributed(_tensor_collectives)
    for result in (r0, r1):
        assert result["gather_a"] == [0, 10, 1, 11]
        assert result["gather_b"] == [[0.0, 0.0], [1.0, 1.0]]
        assert result["gather_b_tag"] == [0, 1]
        assert "gathers tensors, but the data holds a str" in result["mixed"]
        assert result["empty_uneven"] == [0, 2]
        assert result["gather_scalar"] == [0.0, 2.0]
        assert result["reduce_sum"] == [2.0, 1.0]
        assert result["reduce_mean"] == [1.0, 0.5]
        assert result["reduce_scaled"] == [2.0]
        assert result["reduce_max"] == [1.0, 0.0] and result["reduce_min"] == [0.0, -1.0]
        assert result["broadcast"] == [1, 1]
        assert result["objects"] == ["r0", 0, "r1", 1]
        assert result["object"] == [{"rank": 0}, {"rank": 1}]
        assert result["broadcast_objects"] == [0, None]
        assert result["pad_then_gather"] == [[0, 1, -1], [0, 1, 2]]
    assert r0["pad_end"] == [[0, 1, -1]] and r1["pad_end"] == [[0, 1, 2]]
    assert r0["pad_first"] == [[-1, 0, 1]]


def test_single_process_collectives_are_identity_like():
    Accelerator()
    t = torch.arange(3)
    assert gather(t) is t
    assert gather(torch.tensor(5.0)).tolist() == [5.0]
    assert reduce(t, "mean").tolist() == [0.0, 1.0, 2.0]
    assert gather_object([1, 2]) == [1, 2] and gather_object("x") == ["x"]
    assert pad_across_processes(t) is t
    with pytest.raises(ValueError, match="reduction must be 'sum', 'mean', 'max' or 'min'"):
        reduce(t, "median")
    with pytest.raises(TypeError, match="bool tensor is ambiguous"):
        reduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="use_gather_object=True"):
        gather([torch.ones(1), 3])


def _metrics_loop(size: int, batch: int, even: bool, split: bool) -> dict:
    acc = Accelerator(even_batches=even, split_batches=split)
    data = TensorDataset(torch.arange(size), torch.arange(size) * 2)
    loader = acc.prepare(DataLoader(data, batch_size=batch))
    seen, doubled, objects, steps = [], [], [], 0
    for index, twice in loader:
        steps += 1
        gathered_index, gathered_twice = acc.gather_for_metrics((index, twice))
        seen += gathered_index.tolist()
        doubled += gathered_twice.tolist()
        objects += acc.gather_for_metrics([f"s{i}" for i in index.tolist()], use_gather_object=True)
    return {
        "seen": seen,
        "doubled": doubled,
        "objects": objects,
        "steps": steps,
        "len": len(loader),
    }


@pytest.mark.parametrize(
    "batch,even,split",
    [(16, True, False), (8, False, False), (16, True, True), (16, False, True)],
    ids=["even", "uneven", "split", "split-uneven"],
)
def test_gather_for_metrics_sees_every_sample_exactly_once(batch, even, split):
    # 1001 samples: neither a multiple of the batch nor of 2 x batch. Without even_batches
    # the last step's batches differ in size across ranks (1001 = 125 x 8 + 1).
    results = run_distributed(_metrics_loop, 1001, batch, even, split)
    for result in results:
        assert result["seen"] == list(range(1001))
        assert result["doubled"] == [2 * i for i in range(1001)]
        assert result["objects"] == [f"s{i}" for i in range(1001)]
        assert result["steps"] == result["len"]
    if even:
        assert results[0]["steps"] == results[1]["steps"]


def _mismatched_gather() -> str:
    acc = Accelerator(debug=True)
    shape = (2, 3) if acc.process_index == 0 else (4, 3)
    try:
        acc.gather(torch.zeros(shape))
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def _mismatched_operations() -> str:
    acc = Accelerator()
    try:
        if acc.is_main_process:
            acc.gather(torch.zeros(2))
        else:
            acc.reduce(torch.zeros(2))
    except CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_debug_mode_reports_mismatched_shapes_on_every_rank():
    messages = run_distributed(_mismatched_gather, timeout=60)
    for message in messages:
        assert "rank 0: gather" in message and "(2, 3)" in message
        assert "rank 1: gather" in message and "(4, 3)" in message
    assert messages[0] == messages[1]


def test_debug_mode_from_environment_reports_different_operations():
    messages = run_distributed(_mismatched_operations, env={"SLIPSTREAM_DEBUG": "1"}, timeout=60)
    assert messages[0] == messages[1]
    assert "rank 0: gather" in messages[0] and "rank 1: reduce" in messages[0]


def _gather_requires_grad() -> dict:
    acc = Accelerator()
    weight = torch.nn.Parameter(torch.full((2,), float(acc.process_index)))
    loss = weight * 2
    gathered = acc.gather(loss)
    padded = acc.gather(acc.pad_across_processes(loss[: acc.process_index + 1]))
    return {"values": gathered.tolist(), "grad": gathered.requires_grad, "padded": padded.tolist()}


def test_gather_returns_the_values_of_tensors_that_require_grad():
    # Accelerate's gather accepts them; the result carries no autograd history.
    for seen in run_distributed(_gather_requires_grad):
        assert seen == {
            "values": [0.0, 0.0, 2.0, 2.0],
            "grad": False,
            "padded": [0.0, 0.0, 2.0, 2.0],
        }


def _copy_to_devices() -> dict:
    from slipstream.utils import copy_tensor_to_devices

    acc = Accelerator()
    table = torch.arange(6, dtype=torch.int32).reshape(2, 3) if acc.is_main_process else None
    copied = copy_tensor_to_devices(table)
    try:
        copy_tensor_to_devices(torch.zeros(1))  # every process holds one: ambiguous
        error = ""
    except ValueError as problem:
        error = str(problem)
    return {"copied": copied.tolist(), "dtype": str(copied.dtype), "error": error}


def test_copy_tensor_to_devices_needs_no_shape_on_the_receivers():
    for seen in run_distributed(_copy_to_devices):
        assert seen["copied"] == [[0, 1, 2], [3, 4, 5]] and seen["dtype"] == "torch.int32"
        assert "exactly one process" in seen["error"] and "[0, 1]" in seen["error"]
