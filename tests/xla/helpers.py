"""A small training run, the same on the XLA device and on the CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator
from slipstream.runtime.state import reset_shared_state


def fresh_accelerator(**kwargs: Any) -> Accelerator:
    """An Accelerator that joins no earlier one's process state (the CPU reference and the
    XLA run live in one process)."""
    reset_shared_state(reset_partial_state=True)
    return Accelerator(**kwargs)


def model_and_data(
    dropout: float = 0.0, samples: int = 48, batch_size: int = 4
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[Any], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, 6, generator=data)
    targets = torch.randn(samples, 2, generator=data)
    loader = DataLoader(
        TensorDataset(inputs, targets),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
    )
    return model, optimizer, loader, scheduler


def train(
    accelerator: Accelerator,
    parts: tuple[Any, Any, Any, Any],
    *,
    clip: float | None = None,
    batches: int | None = None,
) -> list[float]:
    """Run over the loader (``batches`` of it); returns the losses."""
    model, optimizer, loader, scheduler = parts
    losses = []
    for index, (inputs, targets) in enumerate(loader):
        if batches is not None and index >= batches:
            break
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach().float().cpu()))
    return losses


def weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
