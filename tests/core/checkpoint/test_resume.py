"""Exact resume: N steps straight == k steps, save, new processes, N-k more (bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ProjectConfiguration, set_seed
from tests.distributed import run_distributed


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _train(total: int, save_at: int | None, resume: bool, folder: str, accumulate: int) -> dict:
    acc = Accelerator(
        gradient_accumulation_steps=accumulate,
        project_config=ProjectConfiguration(project_dir=folder, automatic_checkpoint_naming=True),
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(44, 6, generator=generator), torch.randn(44, 1, generator=generator)
    )
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.1 * s))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    if resume:
        acc.load_state()
    micro = 0
    while acc.step < total:
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.seen += len(x)
            micro += 1
            if acc.sync_gradients and acc.step == save_at:
                acc.save_state()
                return {"stopped_at": acc.step}
            if acc.step == total:
                break
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {
        "weights": weights,
        "seen": counter.seen,
        "lr": scheduler.get_last_lr(),
        "epoch": loader.epoch,
        "rng": torch.rand(3),
    }


@pytest.mark.parametrize(
    "save_at,accumulate",
    [(8, 1), (6, 1), (3, 2)],
    ids=["mid-epoch", "epoch-boundary", "mid-epoch-accumulating"],
)
def test_resumed_training_is_bitwise_identical(tmp_path, save_at, accumulate):
    # 44 samples, batch 4, 2 processes: 6 steps per epoch (the last completed from the start).
    total = 14 if accumulate == 1 else 7
    straight = run_distributed(_train, total, None, False, str(tmp_path / "straight"), accumulate)
    first = run_distributed(_train, total, save_at, False, str(tmp_path / "resumed"), accumulate)
    assert first[0]["stopped_at"] == save_at
    resumed = run_distributed(_train, total, None, True, str(tmp_path / "resumed"), accumulate)
    for rank in range(2):
        a, b = straight[rank], resumed[rank]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
        assert a["seen"] == b["seen"] and a["lr"] == b["lr"] and a["epoch"] == b["epoch"]
        assert torch.equal(a["rng"], b["rng"]), "RNG streams continue identically"
