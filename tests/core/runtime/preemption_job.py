"""A small training job for the preemption tests, run with ``slipstream launch``.

One command both starts and resumes: ``load_state("latest")`` after ``prepare``. Options
make one process signal itself at a given step (a preemption that reaches only some
processes), or park the workers in a loop (for the launcher-signal tests).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, set_seed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--signal_rank", type=int, default=-1)
    parser.add_argument("--signal_at", type=int, default=3)
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--park", action="store_true", help="write the pid and loop forever")
    parser.add_argument("--no_preemption", action="store_true")
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--ready_file", default=None, help="written once training has started")
    args = parser.parse_args()

    acc = Accelerator(project_dir=args.project_dir, save_on_preemption=not args.no_preemption)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator)
    )
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    resumed = acc.load_state("latest")
    acc.print(f"resumed from {resumed} at step {acc.step}" if resumed else "fresh start")
    if args.park:
        with open(os.path.join(args.project_dir, f"worker_{acc.process_index}.pid"), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.1)
    while acc.step < args.steps:
        for x, y in loader:
            if (
                resumed is None
                and acc.step == args.signal_at
                and acc.process_index == args.signal_rank
            ):
                os.kill(os.getpid(), getattr(signal, args.signal))
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if args.ready_file and acc.is_main_process and acc.step == 1:
                open(args.ready_file, "w").close()
            time.sleep(args.step_sleep)
            if acc.step >= args.steps:
                break
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        digest = hashlib.sha256()
        for name in sorted(weights):
            digest.update(weights[name].numpy().tobytes())
        print(f"finished at step {acc.step}: checksum {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
