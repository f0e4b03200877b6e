"""Checkpoint every few steps and resume exactly where a stopped run left off.

Runs with automatic checkpoint naming (runs/resume/checkpoints/checkpoint_N, newest 2 kept).
Stop it at any time (or pass --stop_after N) and run it again: it loads the newest complete
checkpoint and continues with the very next batch, bitwise identical to an uninterrupted run.
The held-out loss and accuracy are printed at the start and at the end.

    slipstream launch --num_processes 2 --cpu examples/resume.py --stop_after 7
    slipstream launch --num_processes 2 --cpu examples/resume.py      # continues at step 8

Options: --project_dir DIR, --steps N, --every N, --stop_after N, --quick.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ProjectConfiguration, set_seed


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
    parser.add_argument("--project_dir", default="runs/resume")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="save every N steps")
    parser.add_argument("--stop_after", type=int, default=None, help="pretend to crash here")
    parser.add_argument("--quick", action="store_true", help="30 steps, save every 4 (tests)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every = 30, 4

    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
        )
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(600, 8, generator=generator)
    labels = inputs[:, :4].argmax(dim=1)  # which of the first four features is largest
    train = TensorDataset(inputs[:400], labels[:400])
    held_out = TensorDataset(inputs[400:], labels[400:])
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader, evaluation = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=8, shuffle=True),
        DataLoader(held_out, batch_size=50),
    )

    def report(when: str) -> None:
        loss, accuracy = evaluate(accelerator, model, evaluation)
        accelerator.print(f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f}")

    if os.path.isdir(os.path.join(args.project_dir, "checkpoints")):
        where = accelerator.load_state()  # the newest complete checkpoint
        # No evaluation here: a loader's iterator draws from the random state just restored.
        accelerator.print(f"resumed from {where} at step {accelerator.step}")
    else:
        report("before training")  # an untrained model: loss about ln 4 = 1.386

    while accelerator.step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.step % args.every == 0:
                accelerator.save_state()
            if accelerator.step == args.stop_after:
                accelerator.print(f"stopping at step {accelerator.step} (as asked)")
                return
            if accelerator.step == args.steps:
                break
    report(f"step {accelerator.step}")
    checksum = sum(
        p.detach().double().sum().item() for p in accelerator.unwrap_model(model).parameters()
    )
    accelerator.print(f"finished {accelerator.step} steps, weights checksum {checksum:.10f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
