"""A tiny semi-synchronous (LocalSGD / DiLoCo) fault-tolerant job for the tests, started
with ``slipstream launch --fault_tolerance``: a two-layer regression, one JSON line per
inner step and one per interval's end.

Arguments: OUT_DIR STEPS [--method local_sgd|diloco] [--sync-every H] [--fragments F]
[--delay D] [--momentum M] [--save-at STEP] [--resume] [--die-at STEP] [--until-rejoined]
[--step-sleep S] [--reference LIGHTHOUSE]. With ``--reference`` the process first runs
the same training as a hand-written loop on torchft's own ``Manager`` and
``torchft.local_sgd`` classes (no slipstream; the other lighthouse given, so its quorums
are its own), dealing the same samples, and then the slipstream job.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, FEATURES, HIDDEN, BATCH = 96, 8, 4, 4
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.05, 0.7, 0.9


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float32) / FEATURES
    return TensorDataset(x, (x @ w).unsqueeze(1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, 1))


def weights(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]


def fragments_of(model: nn.Module, parts: int) -> list[nn.Module]:
    """The model's parameters in ``parts`` runs of about equal size, each parameter in the
    run its middle element falls in (how slipstream cuts them), as modules for torchft."""
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    runs = [nn.Module() for _ in range(parts)]
    before = 0
    for name, param in params:
        index = min(parts - 1, (2 * before + param.numel()) * parts // (2 * total))
        runs[index].register_parameter(name.replace(".", "_"), param)
        before += param.numel()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--method", default="diloco")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--until-rejoined", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--reference", default="")
    args = parser.parse_args()
    out = Path(args.out)
    if args.reference:
        reference(args, out)
    train(args, out)


def train(args: argparse.Namespace, out: Path) -> None:
    from ft_job import start_together  # (this script's folder is first on sys.path)

    from slipstream import (
        Accelerator,
        DataLoaderConfiguration,
        FaultToleranceKwargs,
        SemiSyncKwargs,
    )

    semi = SemiSyncKwargs(
        args.method,
        sync_every=args.sync_every,
        fragments=args.fragments,
        fragment_sync_delay=args.delay,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )
    accelerator = Accelerator(
        fault_tolerance=FaultToleranceKwargs(min_replicas=1, timeout=20, semi_sync=semi),
        dataloader_config=DataLoaderConfiguration(data_seed=0),
    )
    ft = accelerator.fault_tolerance
    replica = int(ft.replica_id.rsplit("_", 1)[1])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    name = f"replica{replica}-life{life}"
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    dataset = data()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # Each replica group saves (and a resumed job loads) its own checkpoint: with streaming
    # the groups' weights differ between a fragment's syncs.
    checkpoint = out / f"checkpoint-replica{replica}"
    if args.resume:
        accelerator.load_state(str(checkpoint))
    log = (out / f"{name}.jsonl").open("a", buffering=1)
    (out / f"{name}.pid").write_text(str(os.getpid()))
    start_together(out, "replica*-life0.pid", ft.replica_groups, life)
    dies = life == 0 and replica == 1 and args.die_at >= 0
    full = ft.replica_groups
    missing = done = False
    while not done:  # (an epoch may end inside an interval)
        for x, y in loader:
            started, interval = accelerator.step, ft.current_step()
            index, count = ft.data_coordinates()
            record: dict[str, Any] = {
                "step": started,
                "interval": interval,
                "weights": weights(model),
                "indices": loader.batch_indices,
                "rank": index,
                "world": count,
                "epoch": loader.epoch,
                "lr_used": optimizer.param_groups[0]["lr"],
                "scheduler_steps": scheduler.steps_per_optimizer_step,
            }
            optimizer.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            log.write(json.dumps(record) + "\n")
            discarded = accelerator.optimizer_step_was_skipped
            ended = discarded or ft.current_step() > interval  # the interval ended here
            if ended:
                log.write(json.dumps({"end": interval, "committed": not discarded}) + "\n")
                missing = not discarded and args.until_rejoined and count < full
            if accelerator.step == args.save_at and not discarded:
                accelerator.save_state(str(checkpoint))
            if dies and accelerator.step >= args.die_at:
                (out / "victim-ready").write_text(str(os.getpid()))
                time.sleep(60)  # the test kills us here, between two syncs
            if args.step_sleep:
                time.sleep(args.step_sleep)
            # Every group stops at the same interval's end (a group that rejoined
            # copied the others' step count).
            if ended and accelerator.step >= args.steps and not missing:
                done = True
                break
    trained = weights(model)
    accelerator.end_training()  # syncs what the groups trained since the last sync
    final = {
        "trained": trained,
        "final": weights(model),
        "replica": replica,
        "life": life,
        "steps": accelerator.step,
    }
    log.write(json.dumps(final) + "\n")
    log.close()


def reference(args: argparse.Namespace, out: Path) -> None:
    """The same training hand-written on torchft (both replica groups always in the quorum:
    the lighthouse asks for 2)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.process_group import ProcessGroupGloo

    replica_id = os.environ["SLIPSTREAM_FT_REPLICA_ID"]
    replica = int(replica_id.rsplit("_", 1)[1])
    groups = 2
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=groups,
        use_async_quorum=False,
        timeout=timedelta(seconds=20),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.reference,
        replica_id=replica_id,
        hostname="127.0.0.1",
        init_sync=False,  # both groups build the same model from the same seed
    )
    model = build_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=10, gamma=0.9)
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    if args.method == "local_sgd":
        semi: Any = LocalSGD(manager, model, inner, sync_every=args.sync_every)
    else:
        fragments = fragments_of(model, args.fragments)
        # One outer optimizer per fragment (a shared one would also step the other
        # fragments' parameters with the inner gradients they still hold).
        outer = [
            torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
            for f in fragments
        ]
        semi = DiLoCo(
            manager,
            fragments,
            inner,
            outer,
            sync_every=args.sync_every,
            fragment_sync_delay=args.delay,
            pin_memory=False,
        )
    x_all, y_all = data().tensors
    seed = 0  # the prepared loader's data_seed
    cursor, epoch, order = 0, 0, None
    with semi:
        for step in range(args.steps):
            if order is None:
                generator = torch.Generator().manual_seed(seed + epoch)
                order = torch.randperm(SAMPLES, generator=generator)
            start = cursor + replica * BATCH
            indices = order[start : start + BATCH]
            inner.zero_grad()
            nn.functional.mse_loss(model(x_all[indices]), y_all[indices]).backward()
            inner.step()
            for _ in range(groups):  # a prepared scheduler steps once per process of the job
                scheduler.step()
            cursor += groups * BATCH
            if cursor >= SAMPLES:
                cursor, epoch, order = 0, epoch + 1, None
            del step
    with (out / f"reference-replica{replica}.json").open("w") as log:
        json.dump({"final": weights(model)}, log)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
