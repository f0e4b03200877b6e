"""GPU paths: NCCL process groups, device placement and autocast on CUDA.

Skipped on machines without CUDA (the CPU suite covers the same logic over gloo).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator
from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_single_gpu_placement_and_bf16_autocast():
    acc = Accelerator(mixed_precision="bf16")
    assert acc.device.type == "cuda"
    model = acc.prepare(nn.Sequential(nn.Linear(4, 4)))
    loader = acc.prepare(DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=4))
    (batch,) = next(iter(loader))
    assert batch.device.type == "cuda" and next(model.parameters()).device.type == "cuda"
    assert model(batch).dtype == torch.float32


def _nccl_training() -> dict:
    acc = Accelerator()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        optimizer.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    gathered = acc.gather(torch.tensor([acc.process_index], device=acc.device))
    return {
        "backend": acc.state.backend,
        "device": str(acc.device),
        "gathered": gathered.tolist(),
        "weights": acc.unwrap_model(model).weight.detach().cpu(),
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl_on_two_gpus():
    r0, r1 = run_distributed(_nccl_training, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert r0["backend"] == "nccl" and r0["device"] == "cuda:0" and r1["device"] == "cuda:1"
    assert r0["gathered"] == [0, 1]
    assert torch.equal(r0["weights"], r1["weights"])
