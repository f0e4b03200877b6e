"""Train with DeepSpeed ZeRO-3 in bf16 and save consolidated 16-bit weights.

Needs DeepSpeed (pip install setuptools wheel && pip install --no-build-isolation
deepspeed). On CPU-only machines DeepSpeed runs on its CPU accelerator; the first run
compiles a small communication op (about a minute).

    slipstream launch --num_processes 2 --cpu examples/deepspeed_zero3.py
    slipstream launch --config_file my_deepspeed.yaml examples/deepspeed_zero3.py --from_config

Options: --quick, --from_config (take DeepSpeed settings from the launcher's config),
--save DIR.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, DeepSpeedPlugin, set_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--from_config", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

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
    inputs = torch.randn(256 if args.quick else 4096, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    with accelerator.model_init_context():  # partitioned at creation with zero3_init_flag
        model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for epoch in range(1 if args.quick else 5):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(
            f"epoch {epoch}: loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}"
        )
    if args.save:
        accelerator.save_model(model, args.save, dtype=torch.bfloat16)
        accelerator.print(f"16-bit weights saved to {args.save}")


if __name__ == "__main__":
    main()
