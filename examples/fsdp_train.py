"""Train a small transformer-style model with FSDP2 (fully sharded data parallel).

Each process holds half of every sharded block's parameters, gradients and optimizer
state; the script is the same as for DDP. Runs on CPU processes too.

    slipstream launch --num_processes 2 --cpu --use_fsdp \\
        --fsdp_transformer_layer_cls_to_wrap Block examples/fsdp_train.py
    slipstream launch --num_processes 2 --cpu examples/fsdp_train.py --plugin   # in-script

Prints the held-out loss and accuracy before training and after every epoch.

Options: --quick (one short epoch, for tests), --plugin (configure FSDP in the script), --save DIR (consolidated weights).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FullyShardedDataParallelPlugin, set_seed


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Held-out loss and accuracy, every sample counted once over all processes."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            outputs = model(x)
            losses = F.cross_entropy(outputs, y, reduction="none")
            losses, predictions, y = accelerator.gather_for_metrics(
                (losses, outputs.argmax(dim=1), y)
            )
            loss_sum += float(losses.sum())
            correct += int((predictions == y).sum())
            seen += len(y)
    model.train()
    return loss_sum / seen, correct / seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plugin", action="store_true", help="configure FSDP here")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    plugin = (
        FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
        if args.plugin
        else None
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn((2048 if args.quick else 8192) + 1000, 16, generator=generator)
    labels = inputs[:, :4].argmax(dim=1)  # which of the first four features is largest
    train = TensorDataset(inputs[:-1000], labels[:-1000])
    held_out = TensorDataset(inputs[-1000:], labels[-1000:])
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader, evaluation = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(held_out, batch_size=64),
    )

    processes = accelerator.num_processes

    def report(when: str) -> None:
        loss, accuracy = evaluate(accelerator, model, evaluation)
        accelerator.print(
            f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f} "
            f"({accelerator.distributed_type.value}, {processes} process{'es' if processes > 1 else ''})"
        )

    report("before training")  # an untrained model: loss about ln 4 = 1.386
    for epoch in range(1 if args.quick else 3):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        report(f"epoch {epoch}")
    if args.save:
        accelerator.save_model(model, args.save)  # consolidated safetensors, main process
        accelerator.print(f"weights saved to {args.save}")


if __name__ == "__main__":
    main()
