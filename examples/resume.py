"""Checkpoint every few steps and resume exactly where a stopped run left off.

Runs with automatic checkpoint naming (runs/resume/checkpoints/checkpoint_N, newest 2 kept).
Stop it at any time (or pass --stop_after N) and run it again: it loads the newest complete
checkpoint and continues with the very next batch, bitwise identical to an uninterrupted run.

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
    data = TensorDataset(
        torch.randn(400, 8, generator=generator), torch.randn(400, 1, generator=generator)
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if os.path.isdir(os.path.join(args.project_dir, "checkpoints")):
        where = accelerator.load_state()  # the newest complete checkpoint
        accelerator.print(f"resumed from {where} at step {accelerator.step}")

    while accelerator.step < args.steps:
        for inputs, targets in loader:
            loss = F.mse_loss(model(inputs), targets)
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
    checksum = sum(
        p.detach().double().sum().item() for p in accelerator.unwrap_model(model).parameters()
    )
    accelerator.print(f"finished {accelerator.step} steps, weights checksum {checksum:.10f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
