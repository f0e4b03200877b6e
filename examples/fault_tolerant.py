"""Train through failures: replica groups drop out and rejoin per step (torchft).

The training loop is plain PyTorch plus the four slipstream lines; fault tolerance is one
option object. Run two replica groups, each restarted up to three times, with a lighthouse
the launcher starts itself:

    slipstream launch --cpu -n 2 --fault_tolerance --max_restarts 3 examples/fault_tolerant.py

The default run is long enough (a minute or so on a laptop CPU) to kill one of the worker
processes by hand while it trains: ``ps`` shows each worker's group
(``slipstream.launcher.worker --replica_group replica_1 ...``), then ``kill -9 PID``. The
other group loses at most the step it was in and goes on alone; the killed one is
restarted, copies the model, optimizer, scheduler, RNG and data position from the survivor
and joins again. The launcher says each of these once (``replica group replica_1 lost
(SIGKILL) at step 581; restart 1/3``, ``... rejoined at step 583, state copied from
replica_0 in 0.4 s``) and ends with a summary line per group. Without ``--fault_tolerance``
the script trains as any other.

With ``--semi_sync local_sgd`` or ``--semi_sync diloco`` (and ``--sync_every H``) the
groups train alone and meet every H steps (communication-light training, see
docs/fault-tolerance.md); the script ends with ``accelerator.end_training()``, which syncs
what the groups trained since their last meeting.

It prints the held-out loss and accuracy before training and every few steps (from the
first replica group). Options: --steps N, --lr X, --semi_sync METHOD, --sync_every H,
--outer_lr X and --outer_momentum X (DiLoCo), --quick (a short run, for tests).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FaultToleranceKwargs, SemiSyncKwargs, set_seed


def make_dataset(samples: int, generator: torch.Generator) -> TensorDataset:
    """Points in 16 dimensions, labelled by which of 4 random directions they lean to."""
    directions = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    inputs = torch.randn(samples, 16, generator=generator)
    return TensorDataset(inputs, (inputs @ directions.T).argmax(dim=1))


def evaluate(model: nn.Module, data: TensorDataset) -> tuple[float, float]:
    """Held-out loss and accuracy (every replica group holds the same model)."""
    inputs, targets = data.tensors
    with torch.no_grad():
        outputs = model(inputs)
    accuracy = float((outputs.argmax(dim=1) == targets).float().mean())
    return float(F.cross_entropy(outputs, targets)), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--semi_sync", choices=["local_sgd", "diloco"], default=None)
    parser.add_argument("--sync_every", type=int, default=8)
    parser.add_argument("--outer_lr", type=float, default=0.7)  # DiLoCo's outer SGD
    parser.add_argument("--outer_momentum", type=float, default=0.9)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 60 if args.quick else args.steps

    # The launcher's --fault_tolerance turns it on; here it is also spelled out.
    launched = bool(os.environ.get("SLIPSTREAM_FT_LIGHTHOUSE"))
    semi = None
    if args.semi_sync:
        semi = SemiSyncKwargs(
            args.semi_sync,
            sync_every=args.sync_every,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
        )
    accelerator = Accelerator(
        fault_tolerance=FaultToleranceKwargs(min_replicas=1, enabled=launched, semi_sync=semi)
    )
    set_seed(0)
    train = make_dataset(2048, torch.Generator().manual_seed(1))
    held_out = make_dataset(512, torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # A prepared scheduler steps once per data-parallel process of the whole job (every
    # replica group counted) per optimizer step, as Accelerate's do: its horizon is the
    # optimizer steps times that many, or the rate reaches 0 halfway and climbs back.
    ft = accelerator.fault_tolerance
    processes = accelerator.num_processes * (ft.replica_groups if ft is not None else 1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps * processes)
    loader = DataLoader(train, batch_size=32, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    speaks = accelerator.is_main_process and (ft is None or ft.replica_id.endswith("_0"))

    def report(when: str) -> None:
        loss, accuracy = evaluate(model, held_out)
        if speaks:
            print(f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f}", flush=True)

    report("before training")
    every = max(20, steps // 10)
    # Count steps, not passes: a group that rejoins continues the epoch the others are in.
    while accelerator.step < steps:
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            if accelerator.step % every == 0 and not accelerator.optimizer_step_was_skipped:
                report(f"step {accelerator.step}")
            if accelerator.step >= steps:
                break
    # Semi-synchronous training: sync what the groups trained since they last met.
    accelerator.end_training()
    report(f"after {accelerator.step} steps")
    # (The launcher prints what each replica group went through.)
    if speaks:
        print(f"learning rate at the end: {scheduler.get_last_lr()[0]:.6f} (from {args.lr})")


if __name__ == "__main__":
    main()
