"""DDP training on 2 CPU processes against single-process references on the same data."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, set_seed
from tests.distributed import run_distributed

SAMPLES, PER_PROCESS = 48, 4


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, y, torch.arange(SAMPLES))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    for parameter, grad in zip(model.parameters(), grads, strict=True):
        parameter.grad = grad.clone()
    optimizer.step()


def _shard_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _ddp_against_references(epochs: int) -> dict:
    acc = Accelerator()
    set_seed(0)
    model = _model()
    initial = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=PER_PROCESS, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    shards, first_grads = [], None
    for _ in range(epochs):
        for x, y, index in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            if first_grads is None:
                first_grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            shards.append(acc.gather(index).view(acc.num_processes, -1))

    # Reference 1: one process replays DDP's arithmetic (per-shard gradients, averaged).
    data = _data()
    replay = copy.deepcopy(initial)
    replay_opt = torch.optim.AdamW(replay.parameters(), lr=1e-2)
    # Reference 2: one process, one batch of num_processes x PER_PROCESS samples.
    big = copy.deepcopy(initial)
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-2)
    big_first = None
    for step in shards:
        per_shard = [_shard_grads(replay, data.tensors[0][i], data.tensors[1][i]) for i in step]
        averaged = [
            sum(g / len(per_shard) for g in grads) for grads in zip(*per_shard, strict=True)
        ]
        _step(replay, replay_opt, averaged)
        everything = step.flatten()
        grads = _shard_grads(big, data.tensors[0][everything], data.tensors[1][everything])
        big_first = big_first or grads
        _step(big, big_opt, grads)
    trained = acc.unwrap_model(model)
    return {
        "steps": len(shards),
        "bitwise_replay": all(
            torch.equal(a, b)
            for a, b in zip(trained.parameters(), replay.parameters(), strict=True)
        ),
        "max_diff_big_batch": max(
            (a - b).abs().max().item()
            for a, b in zip(trained.parameters(), big.parameters(), strict=True)
        ),
        "max_first_grad_diff": max(
            (a - b).abs().max().item() for a, b in zip(first_grads, big_first, strict=True)
        ),
        "weights": [p.detach() for p in trained.parameters()],
        "shards": [s.tolist() for s in shards],
    }


def test_ddp_matches_single_process_references():
    r0, r1 = run_distributed(_ddp_against_references, 2)
    assert r0["steps"] == r1["steps"] == 2 * SAMPLES // (2 * PER_PROCESS)
    assert r0["shards"] == r1["shards"]
    for epoch_start in (0, 6):
        seen = sorted(
            i for step in r0["shards"][epoch_start : epoch_start + 6] for s in step for i in s
        )
        assert seen == list(range(SAMPLES)), "each epoch sees every sample once"
    # Gradients are averaged over processes (a sum would be 2x the big-batch gradient).
    assert r0["max_first_grad_diff"] < 1e-6
    assert r0["bitwise_replay"] and r1["bitwise_replay"]
    assert r0["max_diff_big_batch"] < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"], strict=True))


def _scheduler_and_wrapping(split: bool) -> dict:
    acc = Accelerator(split_batches=split)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    optimizer.zero_grad()
    acc.backward(model(torch.ones(2, 8)).sum())
    optimizer.step()
    scheduler.step()
    # DDP's own class where the gradients go over gloo, its subclass through shared memory.
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    try:
        acc.prepare(torch.nn.parallel.DistributedDataParallel(_model()))
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {
        "lr": optimizer.param_groups[0]["lr"],
        "wrapped": wrapped,
        "unwrapped": type(acc.unwrap_model(model)).__name__,
        "type": acc.distributed_type.value,
        "error": error,
    }


def test_scheduler_steps_once_per_process_unless_batches_are_split():
    per_process = run_distributed(_scheduler_and_wrapping, False)[0]
    assert per_process["lr"] == 0.25  # two scheduler steps for one optimizer step
    assert per_process["wrapped"] is True
    assert per_process["unwrapped"] == "Sequential"
    assert per_process["type"] == "MULTI_CPU"
    assert "already wrapped in DistributedDataParallel" in per_process["error"]
    assert run_distributed(_scheduler_and_wrapping, True)[0]["lr"] == 0.5


def _parameter_storage() -> dict:
    acc = Accelerator()
    model = _model()
    before = [(p.data_ptr(), id(p)) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared_model, prepared_optimizer = acc.prepare(model, optimizer)
    after = [(p.data_ptr(), id(p)) for p in acc.unwrap_model(prepared_model).parameters()]
    in_optimizer = [id(p) for group in prepared_optimizer.param_groups for p in group["params"]]
    return {
        "wrapped": isinstance(prepared_model, torch.nn.parallel.DistributedDataParallel),
        "same": before == after,
        "optimizer_same": in_optimizer == [pid for _, pid in before],
    }


def test_prepare_keeps_the_parameters_it_was_given():
    # The wrapper adds no copies: DDP on CPU trains the very tensors the user built.
    for result in run_distributed(_parameter_storage):
        assert result == {
            "wrapped": True,
            "same": True,
            "optimizer_same": True,
        }
