"""gather / gather_for_metrics / reduce / broadcast on XLA processes (one process here: the
results must still be the right values, on the XLA device)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream.utils import broadcast, broadcast_object_list, gather_object, reduce

from .helpers import fresh_accelerator


def test_gather_reduce_and_broadcast_give_the_values_of_one_process() -> None:
    accelerator = fresh_accelerator()
    device = accelerator.device
    values = torch.arange(6.0, device=device).reshape(3, 2)
    gathered = accelerator.gather(values)
    assert gathered.device.type == "xla"
    assert torch.equal(gathered.cpu(), values.cpu())
    scalar = accelerator.gather(torch.tensor(2.5, device=device))
    assert scalar.shape == (1,) and float(scalar.cpu()) == 2.5
    nested = accelerator.gather({"a": values, "b": [values[0]]})
    assert torch.equal(nested["b"][0].cpu(), values[0].cpu())

    assert torch.equal(accelerator.reduce(values, "sum").cpu(), values.cpu())
    assert torch.equal(accelerator.reduce(values, "mean").cpu(), values.cpu())
    assert torch.equal(reduce(values, "max").cpu(), values.cpu())
    assert torch.equal(accelerator.reduce(values, "sum", scale=2.0).cpu(), 2 * values.cpu())
    assert torch.equal(broadcast(values.clone()).cpu(), values.cpu())
    padded = accelerator.pad_across_processes(values, dim=0)
    assert torch.equal(padded.cpu(), values.cpu())
    assert gather_object(["x", 1]) == ["x", 1]
    assert broadcast_object_list([{"k": 1}]) == [{"k": 1}]


def test_gather_for_metrics_keeps_every_sample_once() -> None:
    accelerator = fresh_accelerator()
    labels = torch.arange(10)
    loader = accelerator.prepare(DataLoader(TensorDataset(labels), batch_size=4))
    seen = []
    for (batch,) in loader:
        assert batch.device.type == "xla"
        seen.append(accelerator.gather_for_metrics(batch * 2).cpu())
    assert torch.equal(torch.cat(seen), labels * 2)
    assert accelerator.gather_for_metrics(["a", "b"], use_gather_object=True) == ["a", "b"]
