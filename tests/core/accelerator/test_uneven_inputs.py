"""join_uneven_inputs and trigger_sync_in_backward under real DDP on 2 processes."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from slipstream import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
)
from tests.distributed import run_distributed

SAMPLES = 5


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(SAMPLES, 3, generator=generator), torch.randn(SAMPLES, 1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _train_uneven(override: bool) -> dict[str, Any]:
    # 5 samples, one per process per step: process 0 takes 3 steps, process 1 takes 2.
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=override))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_data()))
    steps = 0
    with accelerator.join_uneven_inputs([model], even_batches=False if override else None):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(_loss(model, x, y))
            optimizer.step()
            steps += 1
    restored = loader.shard.even_batches
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {"steps": steps, "weights": weights, "even_after": restored}


def _reference() -> torch.Tensor:
    """One process: each step averages the two processes' samples; the last step has one
    sample, averaged over the initial world size (what Join's shadow all-reduce gives)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data().tensors
    for pair in ([0, 1], [2, 3], [4]):
        optimizer.zero_grad()
        loss = sum(_loss(model, x[i : i + 1], y[i : i + 1]) for i in pair) / 2
        loss.backward()
        optimizer.step()
    return model.weight.detach()


@pytest.mark.parametrize("override", [False, True], ids=["configured", "overridden"])
def test_join_lets_the_process_with_fewer_batches_finish(override: bool) -> None:
    results = run_distributed(_train_uneven, override)
    assert [r["steps"] for r in results] == [3, 2]
    for result in results:
        torch.testing.assert_close(result["weights"], _reference(), rtol=1e-6, atol=1e-7)
        assert result["even_after"] is override  # the override ends with the block


def _join_errors() -> list[str]:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    messages = []
    try:
        with accelerator.join_uneven_inputs([], even_batches=False):
            pass
    except ValueError as error:
        messages.append(str(error))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([]):  # even batches: nothing to join
            messages.append("even ok")
    messages.extend(str(w.message) for w in caught)
    return messages


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def _join_warnings() -> dict[str, list[str]]:
    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    accelerator.prepare(DataLoader(_data()), DataLoader(_Stream()), DataLoader(_Stream()))
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
    seen["iterable"] = [str(w.message) for w in caught]
    # Accelerate's scripts set the state's type to check the non-DDP branch.
    accelerator.state.distributed_type = DistributedType.FSDP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([object()]):
            pass
    seen["not_ddp"] = [str(w.message) for w in caught]
    return seen


def _not_joinable() -> str:
    accelerator = Accelerator(even_batches=False)
    try:
        with accelerator.join_uneven_inputs([nn.Linear(1, 1)]):
            pass
    except TypeError as error:
        return str(error)
    return "no error"


def test_join_refuses_what_would_hang_or_cannot_join() -> None:
    fsdp = run_distributed(_join_errors)[0]
    assert "works with DDP" in fsdp[0] and "even_batches=True" in fsdp[0]
    assert fsdp[1] == "even ok"
    assert "only supported for multi-GPU training" in fsdp[2] and "FSDP" in fsdp[2]
    assert "takes prepared DDP models" in run_distributed(_not_joinable)[0]


def test_join_warns_as_accelerate_does() -> None:
    seen = run_distributed(_join_warnings)[0]
    # One warning for the two iterable loaders, in Accelerate's words.
    assert len(seen["iterable"]) == 1
    assert "only supported for map-style datasets" in seen["iterable"][0]
    assert len(seen["not_ddp"]) == 1 and "only supported for multi-GPU" in seen["not_ddp"][0]


def _sync_inside_no_sync(trigger: bool) -> torch.Tensor:
    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    x, y = _data().tensors
    rank = accelerator.process_index
    with accelerator.no_sync(model):
        loss = _loss(model, x[rank : rank + 1], y[rank : rank + 1])
        if trigger:
            with accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss)
        else:
            accelerator.backward(loss)
    return accelerator.unwrap_model(model).weight.grad.clone()


def test_trigger_sync_in_backward_averages_inside_no_sync() -> None:
    model = _model()
    x, y = _data().tensors
    per_process = []
    for rank in range(2):
        model.zero_grad()
        _loss(model, x[rank : rank + 1], y[rank : rank + 1]).backward()
        per_process.append(model.weight.grad.clone())
    synced = run_distributed(_sync_inside_no_sync, True)
    for grad in synced:
        torch.testing.assert_close(grad, (per_process[0] + per_process[1]) / 2)
    local = run_distributed(_sync_inside_no_sync, False)
    torch.testing.assert_close(local[0], per_process[0])
    torch.testing.assert_close(local[1], per_process[1])
