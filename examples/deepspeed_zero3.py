"""Train with DeepSpeed ZeRO-3 in bf16 and save consolidated 16-bit weights.

Needs DeepSpeed (pip install setuptools wheel && pip install --no-build-isolation
deepspeed). On CPU-only machines DeepSpeed runs on its CPU accelerator; the first run
compiles a small communication op (about a minute).

    slipstream launch --num_processes 2 --cpu examples/deepspeed_zero3.py
    slipstream launch --config_file my_deepspeed.yaml examples/deepspeed_zero3.py --from_config

Prints the held-out loss and accuracy before training and after every epoch.

Options: --quick (one short epoch, for tests), --from_config (take DeepSpeed settings from the launcher's config),
--save DIR.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, DeepSpeedPlugin, set_seed


def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Held-out loss and accuracy, every sample counted once over all processes."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            outputs = model(x).float()
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
    parser.add_argument("--from_config", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    # DeepSpeed calls torch collectives that torch deprecates, once per step: not ours to fix.
    warnings.filterwarnings("ignore", message=".*torch.distributed.* is deprecated")

    plugin = (
        None
        if args.from_config
        else DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True, gradient_clipping=1.0)
    )
    accelerator = Accelerator(
        deepspeed_plugin=plugin, mixed_precision=None if args.from_config else "bf16"
    )
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn((1024 if args.quick else 2048) + 1000, 16, generator=generator)
    labels = inputs[:, :4].argmax(dim=1)  # which of the first four features is largest
    train = TensorDataset(inputs[:-1000], labels[:-1000])
    held_out = TensorDataset(inputs[-1000:], labels[-1000:])
    with accelerator.model_init_context():  # partitioned at creation with zero3_init_flag
        model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader, evaluation = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=16, shuffle=True),
        DataLoader(held_out, batch_size=64),
    )

    processes = accelerator.num_processes

    def report(when: str) -> None:
        loss, accuracy = evaluate(accelerator, model, evaluation)
        accelerator.print(
            f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f} "
            f"(ZeRO-3, {processes} process{'es' if processes > 1 else ''})"
        )

    report("before training")  # an untrained model: loss about ln 4 = 1.386
    for epoch in range(1 if args.quick else 2):
        for x, y in loader:
            loss = F.cross_entropy(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        report(f"epoch {epoch}")
    if args.save:
        accelerator.save_model(model, args.save, dtype=torch.bfloat16)
        accelerator.print(f"16-bit weights saved to {args.save}")


if __name__ == "__main__":
    main()
