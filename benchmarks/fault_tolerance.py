"""Per-step fault tolerance (torchft): what a SIGKILLed replica group costs the others, and
what fault tolerance costs a healthy DDP step.

Recovery (tests/core/fault_tolerance/ft_job.py: linear regression, 2 replica groups of one
CPU process, ``slipstream launch --fault_tolerance``, heartbeat timeout 2 s, 0.1 s pacing
per step): replica 1 kills itself inside backward at step 3 while replica 0 waits in the
gradient all-reduce, and its agent restarts it. From the per-step logs:

* survivor stall: the longest gap between two steps of the survivor, minus its usual gap;
* steps lost: steps the survivor discarded;
* recovery: seconds from the kill to the restarted group's first step (process start,
  quorum, state copied from the survivor; the survivor trained meanwhile), against a
  checkpoint restart of the same job: a relaunch that loads the latest checkpoint (saved
  every 4 steps) and redoes the steps after it, timed from the relaunch to the step the
  job had reached when it died.

Overhead (``--overhead``): 2 processes started as 2 replica groups; in each, DDP written by
hand over a gloo group of the two (twice: "torch" and the A/A "control"), the same loop
through slipstream with fault tolerance (each process its own group, gradients averaged
over torchft's process group, a quorum and a commit vote every step) and the same loop
written by hand on torchft ("torchft": its ``Manager`` with the synchronous quorum
slipstream uses, its DDP wrapper and ``OptimizerWrapper``, as torchft documents them: the
same quorum and vote) take turns step by step (benchmarks/workers.py pairing), for two
sizes of MLP: "tiny" (256 wide, 4 layers, batch 16: a few milliseconds) and "medium" (1024
wide, 4 layers, batch 64: tens of milliseconds).

Semi-synchronous (in the same processes, after that): hand-written DDP, slipstream with
per-step fault tolerance and slipstream with DiLoCo syncing every H = 1, 8 and 32 steps
take turns by blocks of 32 steps (each block timed step by step and summed; the ratio is
the median over blocks of a block's time against hand-written DDP's in the same round),
with the bytes each process sends to the other groups per step (ring all-reduce: 2 (n - 1)
/ n of what it reduces). Every torchft job here (slipstream's and the hand-written one,
each DiLoCo H) has a lighthouse of its own.

    python benchmarks/fault_tolerance.py [--quick] [--overhead | --recovery]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.distributed import run_fault_tolerant_job  # noqa: E402

JOB = REPO / "tests" / "core" / "fault_tolerance" / "ft_job.py"


def logs(out: Path) -> dict[str, list[dict]]:
    return {
        p.stem: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(out.glob("*.jsonl"))
    }


def checkpoint_restart(
    folder: Path, saved: Path, reached: int, sleep: float, every: int
) -> tuple[float, int]:
    """Relaunch the job from the latest checkpoint in ``saved`` up to step ``reached``:
    the seconds from the relaunch until it is back there, and the step it restarted from."""
    again = folder / "again"
    again.mkdir()
    flags = ["--step-sleep", str(sleep), "--checkpoint", str(saved),
             "--checkpoint-every", str(every), "--resume"]  # fmt: skip
    started = time.time()
    result = run_fault_tolerant_job(
        JOB, again, [str(reached), *flags], processes=2, groups=2, timeout=240
    )
    if result.returncode:
        raise SystemExit(result.stdout[-3000:])
    rows = [r for r in logs(again)["replica0-rank0-life0"] if "step" in r]
    back = max(r["time"] for r in rows if r["step"] == reached - 1) - started
    return back, rows[0]["step"]


def recovery(quick: bool) -> None:
    steps, sleep, every = ("6" if quick else "50"), 0.1, (2 if quick else 4)
    with tempfile.TemporaryDirectory() as folder:
        out, saved = Path(folder) / "kill", Path(folder) / "checkpoints"
        out.mkdir()
        # --quick: this job's checkpoints serve the checkpoint restart below (one job less).
        saving = ["--checkpoint", str(saved), "--checkpoint-every", str(every)] if quick else []
        result = run_fault_tolerant_job(
            JOB, out, [steps, "--die-at", "3", "--die-mode", "allreduce", "--step-sleep",
                       str(sleep), "--until-rejoined", *saving],
            processes=2, groups=2, timeout=240,
        )  # fmt: skip
        if result.returncode:
            raise SystemExit(result.stdout[-3000:])
        found = logs(out)
        survivor = [r for r in found["replica0-rank0-life0"] if "step" in r]
        victim = [r for r in found["replica1-rank0-life0"] if "step" in r]
        reborn = [r for r in found["replica1-rank0-life1"] if "step" in r]
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(survivor)]
        usual = statistics.median(gaps)
        lost = sum(not r["committed"] for r in survivor)
        # It logs step 2, paces, then sleeps 0.5 s in step 3's backward and dies.
        killed_at = victim[-1]["time"] + sleep + 0.5
        rejoin = reborn[0]["time"] - killed_at
        rejoined_at = reborn[0]["step"]
        if quick:  # back one step past the latest checkpoint
            reached = max(int(path.name[5:]) for path in saved.glob("step_*")) + 1
            back, first_redone = checkpoint_restart(Path(folder), saved, reached, sleep, every)
    # Checkpoint restart: the same job ran to step `reached` with a checkpoint every 4
    # steps, then died whole; the relaunch loads the latest one and redoes the rest.
    if not quick:
        reached = 10
        with tempfile.TemporaryDirectory() as folder:
            out, saved = Path(folder) / "first", Path(folder) / "checkpoints"
            out.mkdir()
            flags = ["--step-sleep", str(sleep), "--checkpoint", str(saved),
                     "--checkpoint-every", str(every)]  # fmt: skip
            result = run_fault_tolerant_job(
                JOB, out, [str(reached), *flags], processes=2, groups=2, timeout=240
            )
            if result.returncode:
                raise SystemExit(result.stdout[-3000:])
            back, first_redone = checkpoint_restart(Path(folder), saved, reached, sleep, every)
    print("| measure | value |")
    print("|---|---|")
    print(
        f"| survivor stall on the dead peer (longest step gap minus usual) | "
        f"{max(gaps) - usual:.2f} s |"
    )
    print(f"| steps the survivor lost | {lost} |")
    print(
        f"| fault tolerance: kill → restarted group's first step (at step {rejoined_at}; "
        f"the survivor trained on meanwhile) | {rejoin:.2f} s |"
    )
    print(
        f"| checkpoint restart: relaunch → back at step {reached} (loads the step-"
        f"{first_redone} checkpoint, redoes {reached - first_redone} steps; the whole job "
        f"idle meanwhile) | {back:.2f} s |"
    )
    print(f"| survivor's usual step (incl. {sleep} s pacing) | {usual:.3f} s |")  # fmt: skip


# -- overhead: paired steps, DDP by hand (twice) against slipstream with fault tolerance ----
#: name: (width, layers, per-process batch, (generations, rounds, timed steps), quick ones)
SIZES = {
    "tiny": (256, 4, 16, (4, 60, 3), (1, 4, 2)),
    "medium": (1024, 4, 64, (3, 16, 3), (1, 3, 2)),
}
WIDTH, LAYERS, BATCH = SIZES["tiny"][:3]  # the size this worker measures


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _loader(steps: int, rank: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(1)
    count = steps * 2 * BATCH
    data = TensorDataset(
        torch.randn(count, WIDTH, generator=generator),
        torch.randn(count, WIDTH, generator=generator),
    )
    # Process r takes the r-th contiguous batch of every global batch.
    order = [s * 2 * BATCH + rank * BATCH + i for s in range(steps) for i in range(BATCH)]
    return DataLoader(data, batch_size=BATCH, sampler=order)


class HandDDP:
    name = "torch"

    def __init__(self, steps: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn

        self.model = nn.parallel.DistributedDataParallel(_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.loader = _loader(steps, dist.get_rank())

    def step(self, batch: Any) -> None:
        import torch.nn.functional as F

        x, y = batch
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.optimizer.step()

    def weights(self) -> list[Any]:
        return [p.detach().clone() for p in self.model.module.parameters()]

    def close(self) -> None:
        pass


class Control(HandDDP):
    name = "control"


class FaultTolerant(HandDDP):
    """slipstream with fault tolerance: this process is a replica group of its own."""

    name = "fault-tolerant"
    #: DiLoCo's sync interval (0: per-step fault tolerance); the variant's lighthouse.
    every = 0
    lighthouse: str | None = None

    def __init__(self, steps: int) -> None:
        import torch
        import torch.distributed as dist

        from slipstream import Accelerator, FaultToleranceKwargs, SemiSyncKwargs

        semi = SemiSyncKwargs("diloco", sync_every=self.every) if self.every else None
        options = FaultToleranceKwargs(lighthouse=self.lighthouse, semi_sync=semi)
        self.accelerator = Accelerator(cpu=True, fault_tolerance=options)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # The same batches as the hand-written loop; the quorum opens at zero_grad, inside
        # the timed step.
        self.loader = _loader(steps, dist.get_rank())

    def step(self, batch: Any) -> None:
        import torch.nn.functional as F

        x, y = batch
        self.optimizer.zero_grad()
        self.accelerator.backward(F.mse_loss(self.model(x), y))
        self.optimizer.step()

    def weights(self) -> list[Any]:
        return [p.detach().clone() for p in self.accelerator.unwrap_model(self.model).parameters()]

    def bytes_sent(self) -> int:
        semi = self.accelerator.fault_tolerance.semi_sync
        return int(semi.bytes_synced) if semi is not None else -1

    def close(self) -> None:
        self.accelerator.fault_tolerance.shutdown()


class HandTorchft(HandDDP):
    """The DDP loop written by hand on torchft: its Manager (synchronous quorum, as
    slipstream's), its DDP wrapper (a comm hook all-reducing each bucket through the
    manager) and OptimizerWrapper (zero_grad starts the quorum, step votes)."""

    name = "torchft"
    lighthouse = ""

    def __init__(self, steps: int) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torchft import Manager
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo

        rank = dist.get_rank()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        model = _model()
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
            load_state_dict=model.load_state_dict,
            state_dict=model.state_dict,
            min_replica_size=1,
            use_async_quorum=False,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self.store.port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"replica_{rank}",
            hostname="127.0.0.1",
            init_sync=False,
        )
        self.model = DistributedDataParallel(self.manager, model)
        self.optimizer = OptimizerWrapper(
            self.manager, torch.optim.SGD(self.model.parameters(), lr=1e-3)
        )
        self.loader = _loader(steps, rank)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


#: DiLoCo's sync intervals measured against per-step fault tolerance and DDP.
EVERY = (1, 8, 32)
BLOCK = 32  # steps per variant and round in the semi-synchronous comparison
QUICK_BLOCK = 4  # --quick: 4 rounds of 4 steps (DiLoCo every 8 steps still syncs)


def _diloco(every: int, lighthouse: str) -> type[FaultTolerant]:
    return type(
        f"DiLoCo{every}", (FaultTolerant,), {"name": f"diloco-{every}", "every": every,
                                            "lighthouse": lighthouse}
    )  # fmt: skip


def overhead_worker(
    port: int, generations: int, rounds: int, timed: int, size: int, block: int,
    *lighthouses: str,
) -> None:  # fmt: skip
    import torch.distributed as dist

    global WIDTH, LAYERS, BATCH
    WIDTH, LAYERS, BATCH = list(SIZES.values())[size][:3]

    sys.path.insert(0, str(REPO / "benchmarks"))
    import workers  # benchmarks/workers.py

    from slipstream import PartialState

    PartialState()  # this process's slipstream state: one process, its own replica group
    rank = int(os.environ["SLIPSTREAM_FT_REPLICA_ID"].rsplit("_", 1)[1])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)  # the hand-made DDP
    HandTorchft.lighthouse = lighthouses[0]
    variants: list[Any] = [HandDDP, FaultTolerant, Control, HandTorchft]
    warmup = 1

    def generation(order: list[Any], wall: Any, cpu: Any) -> tuple[dict[str, bool], float]:
        runs = [kind(rounds * (warmup + timed)) for kind in order]
        workers.time_rounds(runs, rounds, timed, warmup, wall, cpu)
        reference = next(run for run in runs if run.name == "torch").weights()
        gaps = {}
        for run in runs:
            gaps[run.name] = max(
                float((a - b).abs().max()) for a, b in zip(reference, run.weights(), strict=True)
            )
            run.close()
        # DDP averages in its buckets, torchft sums then divides: equal to rounding.
        same = {name: gap < 1e-6 for name, gap in gaps.items() if name != "torch"}
        return same, max(gaps.values())

    wall, cpu, equal, gaps = workers.run_generations(variants, generations, generation)
    report = {**workers.paired_statistics(wall, cpu, timed), "weights_equal": equal,
              "largest_weight_gap": max(gaps)}  # fmt: skip
    # Against the same loop hand-written on torchft, step by step.
    ft, hand = wall["fault-tolerant"], wall["torchft"]
    report["vs_torchft"] = {
        "ratio": workers.median_ratio(ft, [hand]),
        "interval": workers.median_ratio_interval(ft, [hand], timed),
    }
    report["semi"] = semi_synchronous(workers, rounds, block, lighthouses[1:])
    if rank == 0:
        workers.report(report)
    dist.destroy_process_group()


def semi_synchronous(
    workers: Any, rounds: int, block: int, lighthouses: tuple[str, ...]
) -> dict[str, Any]:
    """Blocks of ``block`` steps: DDP by hand, per-step fault tolerance, DiLoCo every H
    steps; per variant the median block ratio to DDP (with its 95% interval over rounds)
    and the bytes sent per step."""
    import torch.distributed as dist

    kinds: list[Any] = [HandDDP, FaultTolerant, *map(_diloco, EVERY, lighthouses)]
    runs = [kind(rounds * block) for kind in kinds]
    wall: dict[str, list[float]] = {run.name: [] for run in runs}
    cpu: dict[str, list[float]] = {run.name: [] for run in runs}
    workers.time_rounds(runs, rounds, block, 0, wall, cpu)
    steps = rounds * block
    params = sum(p.numel() * p.element_size() for p in _model().parameters())
    ring = 2 * (dist.get_world_size() - 1) / dist.get_world_size()
    blocks = {
        name: [sum(values[i : i + block]) for i in range(block, len(values), block)]
        for name, values in wall.items()  # (the first round warms up)
    }
    result: dict[str, Any] = {}
    for run in runs:
        sent = run.bytes_sent() if hasattr(run, "bytes_sent") else -1
        ratios = [v / b for v, b in zip(blocks[run.name], blocks["torch"], strict=True)]
        result[run.name] = {
            "step_ms": 1e3 * statistics.median(blocks[run.name]) / block,
            "ratio": statistics.median(ratios),
            "interval": _interval(ratios),
            "bytes_per_step": sent / steps if sent >= 0 else ring * params,
        }
        if hasattr(run, "close"):
            run.close()
    return result


def _interval(ratios: list[float], draws: int = 300) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios``."""
    import random

    pick = random.Random(1)
    estimates = sorted(statistics.median(pick.choices(ratios, k=len(ratios))) for _ in range(draws))
    return estimates[int(0.025 * draws)], estimates[int(0.975 * draws) - 1]


def overhead(quick: bool, sizes: list[str]) -> None:
    from contextlib import ExitStack

    from slipstream.fault_tolerance.lighthouse import Lighthouse, free_port

    sys.path.insert(0, str(REPO / "benchmarks"))
    import workers

    for name in sizes:
        width, layers, batch, full, short = SIZES[name]
        generations, rounds, timed = short if quick else full
        block = QUICK_BLOCK if quick else BLOCK
        with ExitStack() as stack:
            # One for the hand-written torchft loop, one per DiLoCo interval.
            lighthouses = [
                stack.enter_context(Lighthouse(min_replicas=2, heartbeat_timeout=2)).address
                for _ in range(1 + len(EVERY))
            ]
            command = [sys.executable, "-m", "slipstream.cli", "launch", "--cpu", "-n", "2",
                       "--fault_tolerance", "--ft_heartbeat_timeout", "2", "--ft_min_replicas", "2",
                       __file__, "--worker",
                       str(free_port()), str(generations), str(rounds), str(timed),
                       str(list(SIZES).index(name)), str(block), *lighthouses]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        reports = [
            json.loads(line[6:]) for line in done.stdout.splitlines() if line[:6] == "BENCH "
        ]
        if not reports:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        result = reports[0]
        print(f"{name}: MLP {width} wide, {layers} layers, batch {batch} per process")
        workers.print_step_ratios(name, result, 6)
        print(f"{result['steps']} paired steps per variant; largest weight difference to DDP "
              f"{result['largest_weight_gap']:.1e}")  # fmt: skip
        versus = result["vs_torchft"]
        low, high = versus["interval"]
        print(f"{name:6s} fault-tolerant vs the hand-written torchft loop: "
              f"{versus['ratio']:.3f}x ({low:.3f}-{high:.3f})")  # fmt: skip
        print(f"{name}: blocks of {block} steps against hand-written DDP")
        for variant, row in result["semi"].items():
            low, high = row["interval"]
            print(f"{name:6s} {variant:15s} step {row['step_ms']:8.3f} ms  ratio "
                  f"{row['ratio']:.3f}x ({low:.3f}-{high:.3f})  sends "
                  f"{row['bytes_per_step'] / 1e3:9.1f} kB per step")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--overhead", action="store_true", help="only the step overhead")
    parser.add_argument("--recovery", action="store_true", help="only the recovery table")
    parser.add_argument(
        "--size", choices=[*SIZES, "all"], default="all", help="the model of --overhead"
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        overhead_worker(*map(int, args.worker[:6]), *args.worker[6:])
        return
    if not args.overhead:
        recovery(args.quick)
    if not args.recovery:
        every = ["tiny"] if args.quick else list(SIZES)  # --quick: the suite's smoke run
        overhead(args.quick, every if args.size == "all" else [args.size])


if __name__ == "__main__":
    main()
