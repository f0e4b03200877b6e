"""The Accelerator facade: prepare(), process control helpers and their errors."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, PrepareError, set_seed
from slipstream.optim.optimizer import AcceleratedOptimizer
from slipstream.optim.scheduler import AcceleratedScheduler
from slipstream.runtime.splitting import split_sequence
from tests.distributed import run_distributed


def _parts():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.ones(6, 3)), batch_size=2)
    return model, optimizer, scheduler, loader


def test_prepare_returns_objects_in_the_order_given():
    acc = Accelerator()
    model, optimizer, scheduler, loader = _parts()
    other = {"keep": "me"}
    out = acc.prepare(scheduler, loader, other, optimizer, model)
    assert isinstance(out[0], AcceleratedScheduler)
    assert isinstance(out[1], DataLoader) and out[2] is other
    assert isinstance(out[3], AcceleratedOptimizer) and isinstance(out[3], torch.optim.Optimizer)
    assert out[4] is model and next(model.parameters()).device == acc.device
    assert acc.prepare(nn.Linear(1, 1)).__class__ is nn.Linear, "one object comes back alone"


def test_the_four_line_loop_trains_on_one_process():
    acc = Accelerator()
    set_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, loader, scheduler = acc.prepare(
        model, optimizer, DataLoader(data, batch_size=8, shuffle=True), scheduler
    )
    losses = []
    for _ in range(5):
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert acc.step == 40


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda p: (p[0], p[0]), "same Linear twice"),
        (lambda p: (p[2],), "whose optimizer has not been prepared"),
    ],
    ids=["duplicate", "scheduler-without-optimizer"],
)
def test_prepare_rejects_bad_combinations(build, message):
    acc = Accelerator()
    with pytest.raises(PrepareError, match=message):
        acc.prepare(*build(_parts()))


def test_prepare_hands_objects_prepared_before_back_as_they_are():
    acc = Accelerator()
    model, optimizer, scheduler, loader = _parts()
    model, optimizer = acc.prepare(model, optimizer)
    assert acc.prepare(optimizer) is optimizer and acc.prepare(model) is model
    assert acc._optimizers == [optimizer] and acc._models == [model], "registered once"
    assert isinstance(acc.prepare(scheduler), AcceleratedScheduler), "optimizer known from before"
    with pytest.raises(PrepareError, match="one bool per object"):
        acc.prepare(loader, device_placement=[True, False])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"mixed_precision": "fp9"}, "unknown mixed_precision 'fp9'"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be"),
        ({"kwargs_handlers": [object()]}, "kwargs_handlers takes option objects"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Accelerator(**kwargs)


def test_bf16_forward_returns_fp32_and_unwrap_restores():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(nn.Sequential(nn.Linear(4, 4)))
    inner = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    assert model(torch.ones(2, 4)).dtype == torch.float32
    assert inner == [torch.bfloat16], "the layer itself ran in bf16"
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.ones(2, 4)).dtype == torch.float32 and inner[-1] == torch.float32


def test_single_process_helpers():
    acc = Accelerator()
    assert (acc.num_processes, acc.process_index, acc.is_main_process, acc.is_last_process) == (
        1,
        0,
        True,
        True,
    )
    assert acc.distributed_type.value == "NO"
    with acc.main_process_first(), acc.local_main_process_first():
        pass
    with acc.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    model = acc.prepare(nn.Linear(1, 1))
    assert acc.free_memory(model) == [None] and acc._models == []
    acc.wait_for_everyone()


@pytest.mark.parametrize(
    "inputs,world,padding,expected",
    [
        ([1, 2, 3, 4, 5], 2, False, [[1, 2, 3], [4, 5]]),
        ([1, 2, 3, 4, 5], 2, True, [[1, 2, 3], [4, 5, 5]]),
        ([1, 2], 3, False, [[1], [2], []]),
        (
            {"a": [1, 2, 3], "b": (7, 8, 9)},
            2,
            False,
            [{"a": [1, 2], "b": (7, 8)}, {"a": [3], "b": (9,)}],
        ),
    ],
)
def test_split_sequence(inputs, world, padding, expected):
    assert [split_sequence(inputs, r, world, padding) for r in range(world)] == expected


def test_split_sequence_tensors_and_errors():
    parts = [split_sequence(torch.arange(5), r, 2, True).tolist() for r in range(2)]
    assert parts == [[0, 1, 2], [3, 4, 4]]
    with pytest.raises(TypeError, match="takes a list"):
        split_sequence(5, 0, 2)
    with pytest.raises(ValueError, match="same length"):
        split_sequence({"a": [1], "b": [1, 2]}, 0, 2)


def _process_control(marker: str) -> dict:
    acc = Accelerator()
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        acc.print("hello from", acc.process_index)
    calls = []

    @acc.on_main_process
    def main_only():
        calls.append("main")

    @acc.on_process(process_index=1)
    def second_only():
        calls.append("second")

    @acc.on_last_process
    def last_only():
        calls.append("last")

    @acc.on_local_main_process
    def local_main_only():
        calls.append("local-main")

    @acc.on_local_process(local_process_index=1)
    def second_local_only():
        calls.append("local-1")

    main_only(), second_only(), last_only(), local_main_only(), second_local_only()
    with acc.main_process_first(), open(marker, "a") as handle:
        if acc.is_main_process:
            time.sleep(0.5)  # the other rank must still wait for us
        handle.write(f"{acc.process_index}\n")
    with acc.split_between_processes(list(range(5)), apply_padding=True) as mine:
        share = mine
    return {"printed": captured.getvalue(), "calls": calls, "share": share}


def test_process_control_on_two_processes(tmp_path):
    marker = str(tmp_path / "order.txt")
    r0, r1 = run_distributed(_process_control, marker)
    assert r0["printed"] == "hello from 0\n" and r1["printed"] == ""
    assert r0["calls"] == ["main", "local-main"]
    assert r1["calls"] == ["second", "last", "local-1"]
    with open(marker) as handle:
        assert handle.read().split() == ["0", "1"]
    assert r0["share"] == [0, 1, 2] and r1["share"] == [3, 4, 4]


def test_set_seed_reproduces_and_device_specific_offsets():
    set_seed(11)
    first = torch.rand(3)
    set_seed(11)
    assert torch.equal(first, torch.rand(3))
    Accelerator()
    set_seed(11, device_specific=True)  # process 0: same as plain
    assert torch.equal(first, torch.rand(3))
    assert os.environ.get("RANK") is None
