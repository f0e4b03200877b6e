"""Distributed evaluation with torchmetrics that is exact on an uneven dataset.

1001 evaluation samples with batch 16 fit evenly on neither 1 nor 2 processes; the prepared
metrics skip the samples sharding duplicated, so every process count prints the same
numbers. Needs torchmetrics (pip install "slipstream[torchmetrics]"). Run:

    python examples/evaluate_metrics.py
    slipstream launch --num_processes 2 --cpu examples/evaluate_metrics.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

from slipstream import Accelerator, set_seed


def main() -> None:
    accelerator = Accelerator()
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1001, 16, generator=generator)
    labels = (inputs[:, :4] + 0.5 * torch.randn(1001, 4, generator=generator)).argmax(dim=1)
    model = nn.Linear(16, 4)
    with torch.no_grad():  # a fixed "trained" classifier, the same on every process
        model.weight.copy_(torch.eye(4, 16))
        model.bias.zero_()

    loader = DataLoader(TensorDataset(inputs, labels), batch_size=16)
    metrics = MetricCollection(
        {
            "accuracy": MulticlassAccuracy(num_classes=4),
            "f1": MulticlassF1Score(num_classes=4, average="macro"),
            "auroc": MulticlassAUROC(num_classes=4),
        }
    )
    model, loader, metrics = accelerator.prepare(model, loader, metrics)

    model.eval()
    with torch.no_grad():
        for batch_inputs, batch_labels in loader:
            metrics.update(model(batch_inputs).softmax(dim=-1), batch_labels)
    results = metrics.compute()  # collective: every process computes the same values
    shown = ", ".join(f"{name} {value.item():.6f}" for name, value in sorted(results.items()))
    accelerator.print(f"{shown} ({accelerator.num_processes} processes)")


if __name__ == "__main__":
    main()
