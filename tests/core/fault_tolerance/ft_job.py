"""A tiny fault-tolerant training job for the tests and the benchmark, started with
``slipstream launch --fault_tolerance``: linear regression, one JSON line per step.

Arguments: OUT_DIR STEPS [--die-at STEP --die-replica N|-1 --die-mode allreduce|wait]
[--also-die N:STEP:MODE] [--step-sleep S] [--fsdp] [--hidden N] [--until-rejoined]
[--linger S]. A dying replica group dies only in its first life.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FaultToleranceKwargs, FullyShardedDataParallelPlugin

SAMPLES, FEATURES, BATCH = 96, 8, 4


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float32) / FEATURES
    return TensorDataset(x, (x @ w).unsqueeze(1))


def build_model(hidden: int) -> nn.Module:
    """A linear model, or two linear layers (``hidden`` wide: a tensor-parallel plan
    "0=colwise,1=rowwise" splits them), built from seed 0."""
    torch.manual_seed(0)
    if not hidden:
        return nn.Linear(FEATURES, 1)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Linear(hidden, 1))


def weights(model: nn.Module) -> list[float]:
    values = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        values += full.detach().reshape(-1).tolist()
    return values


def start_together(out: Path, pid_files: str, groups: int, life: int) -> None:
    """In the first life, wait (up to a minute) until every replica group's process has
    written its pid file (``pid_files``: a glob in ``out``) before the first step, so the
    first quorum holds every group, as the tests' reference timelines assume. Workers forked
    from the launcher start within a fraction of a second of their agent, and a group that
    starts first would otherwise train its first steps alone before the others join."""
    deadline = time.monotonic() + 60.0
    while life == 0 and len(list(out.glob(pid_files))) < groups and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-replica", type=int, default=1)
    parser.add_argument("--die-mode", default="wait")
    # A second victim in the same job (REPLICA:STEP:MODE), so one launch covers both ways
    # of dying: inside the all-reduce and killed from outside between steps.
    parser.add_argument("--also-die", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--hidden", type=int, default=0)
    # Keep training past STEPS while a group is missing, so the restarted group always
    # rejoins a live job (however slowly the machine restarts it).
    parser.add_argument("--until-rejoined", action="store_true")
    # Replica 0 saves the state every K steps into DIR/step_N; a run with --resume loads the
    # latest one first (the checkpoint-restart comparison of the benchmark).
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    # Stay this many seconds after the script ended and the group left the quorum (an
    # exit handler that runs after slipstream's): the launcher sees the group end only then.
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    if args.linger:
        atexit.register(time.sleep, args.linger)
    torch.manual_seed(0)
    plugin = FullyShardedDataParallelPlugin() if args.fsdp else None
    accelerator = Accelerator(
        fault_tolerance=FaultToleranceKwargs(min_replicas=1, timeout=20), fsdp_plugin=plugin
    )
    ft = accelerator.fault_tolerance
    replica = int(ft.replica_id.rsplit("_", 1)[1])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = build_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    dataset = data()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    saved = sorted(Path(args.checkpoint or ".").glob("step_*"), key=lambda p: int(p.name[5:]))
    if args.resume and saved:
        accelerator.load_state(str(saved[-1]))
    # --die-replica -1: every group dies (the job falls back to its checkpoint).
    victims = {args.die_replica: (args.die_at, args.die_mode)}
    if args.also_die:
        other, step, mode = args.also_die.split(":")
        victims[int(other)] = (int(step), mode)
    die_at, die_mode = victims.get(replica, victims.get(-1, (-1, "")))
    dies = life == 0 and die_at >= 0
    out = Path(args.out)
    name = f"replica{replica}-rank{accelerator.process_index}-life{life}"
    log = (out / f"{name}.jsonl").open("a", buffering=1)
    (out / f"{name}.pid").write_text(str(os.getpid()))
    # What `ps` shows of this worker and of its group's agent (its parent).
    commands = [Path(f"/proc/{pid}/cmdline") for pid in (os.getpid(), os.getppid())]
    if all(path.exists() for path in commands):
        shown = [path.read_bytes().replace(b"\0", b" ").decode() for path in commands]
        (out / f"{name}.ps").write_text("\n".join(shown))
    start_together(
        out, f"replica*-rank{accelerator.process_index}-life0.pid", ft.replica_groups, life
    )

    def die(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
        return grad

    full = ft.state.data_parallel.num_processes * ft.replica_groups
    missing = False  # a committed step ran without every group
    while accelerator.step < args.steps or missing:
        for x, y in loader:
            started = accelerator.step
            seen = weights(model)  # after a rejoin: the weights copied from a peer
            index, count = ft.data_coordinates()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if dies and die_mode == "allreduce" and started >= die_at:
                # Dies inside backward (a hook on the loss fires under DDP, FSDP2 and TP
                # alike) while the other groups wait in the gradient all-reduce; at the
                # first step from STEP on (a group that started late still dies).
                loss.register_hook(die)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            record = {
                "replica": replica,
                "life": life,
                "step": started,
                "committed": not accelerator.optimizer_step_was_skipped,
                "ft_step": ft.current_step(),
                "indices": loader.batch_indices,
                # What it trained on, the repeats at the end of an epoch included.
                "trained": [int((dataset.tensors[0] == row).all(1).nonzero()[0]) for row in x],
                "rank": index,
                "world": count,
                "epoch": loader.epoch,
                "cursor": loader.committed_samples,
                "weights": seen,
                "lr_used": lr,
                "lr": scheduler.get_last_lr()[0],
                "scheduler_steps": scheduler.steps_per_optimizer_step,
                "loss": loss.item(),
                "time": time.time(),
                "quorum_seconds": ft.last_quorum_seconds,
                "strategy": accelerator.strategy.name,
            }
            log.write(json.dumps(record) + "\n")
            if record["committed"]:
                missing = args.until_rejoined and count < full
                every = args.checkpoint_every
                if replica == 0 and every and accelerator.step % every == 0:
                    accelerator.save_state(str(Path(args.checkpoint) / f"step_{accelerator.step}"))
            if dies and die_mode == "wait" and accelerator.step >= die_at:
                (out / "victim-ready").write_text(str(os.getpid()))
                time.sleep(60)  # the test kills us here
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if accelerator.step >= args.steps and not missing:
                break
    log.write(json.dumps({"final": weights(model), "replica": replica, "life": life}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
