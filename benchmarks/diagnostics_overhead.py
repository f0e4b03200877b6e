"""What knowing what the job does costs: the DDP step of ``ddp_overhead.py`` with the
diagnostics left on, against the same loop hand-written.

Variants, measured as ``ddp_overhead.py`` measures (paired steps, rotating order, a second
copy of the hand-written loop as the A/A control):

* ``slipstream``: the prepared loop as it is by default, which already runs the hang
  watchdog (a thread that looks at two numbers every few seconds) and records its
  collectives for hang reports;
* ``diagnosed``: the same with ``StragglerMonitor`` and ``ThroughputMonitor`` (model FLOPs
  counted on one step with ``FlopCounterMode``, which that step pays) logging every 50 steps;
* ``guarded``: ``diagnosed`` plus ``BadStepGuard`` (off by default: one small all-reduce and
  a gradient norm per step).

torch's Flight Recorder (which slipstream switches on for hang reports) is on for every
variant here, as the process group is formed once for all of them: its cost is measured on
its own, as the CPU time of a gloo all-reduce with and without it (one process).

    python benchmarks/diagnostics_overhead.py            # tiny and medium model
    python benchmarks/diagnostics_overhead.py --quick    # smoke test

With ``--quick`` (the tiny model, 2 rounds) the two recorder probes start through
``workers.run_workers`` like the training workers, each switching the recorder on or off
in its own process before its group forms, instead of through their environment.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

import ddp_overhead  # benchmarks/ddp_overhead.py, beside this script
import torch
import torch.distributed as dist
import workers
from ddp_overhead import ROUNDS, SIZES, Control, HandWritten, Slipstream


class Diagnosed(Slipstream):
    name = "diagnosed"

    def callbacks(self) -> list[Any]:
        from slipstream import StragglerMonitor, ThroughputMonitor

        return [StragglerMonitor(log_every_n_steps=50), ThroughputMonitor(log_every_n_steps=50)]

    def accelerator_class(self) -> Any:  # type: ignore[override]
        from slipstream import Accelerator

        return functools.partial(Accelerator, callbacks=self.callbacks())


class Guarded(Diagnosed):
    name = "guarded"

    def callbacks(self) -> list[Any]:
        from slipstream import BadStepGuard

        return [*super().callbacks(), BadStepGuard()]


def _variants() -> list[type[HandWritten]]:
    return [HandWritten, Slipstream, Diagnosed, Guarded, Control]


def worker(size: str, generations: int, rounds: int, timed: int) -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # as slipstream forms its groups
    dist.init_process_group("gloo")
    wall, cpu, equal, _ = workers.run_generations(
        _variants(),
        generations,
        lambda order, wall, cpu: ddp_overhead._generation(order, size, rounds, timed, wall, cpu),
    )
    if dist.get_rank() == 0:
        workers.report(
            {"size": size, **workers.paired_statistics(wall, cpu, timed), "weights_equal": equal}
        )
    dist.destroy_process_group()


def recorder_probe(calls: int, recorder: bool | None = None) -> None:
    """CPU microseconds per one-process gloo all-reduce (run with and without the recorder).

    ``recorder`` (``--quick``) switches the recorder on or off in this process before its
    group forms, as slipstream does; otherwise the environment it started with decides."""
    if recorder is not None:
        for name in [name for name in os.environ if name.startswith("TORCH_FR")]:
            del os.environ[name]
        if recorder:
            os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(8)
    for _ in range(500):
        dist.all_reduce(tensor)
    samples = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(calls):
            dist.all_reduce(tensor)
        samples.append((time.process_time() - start) / calls * 1e6)
    workers.report({"probe_us": sorted(samples)[len(samples) // 2]})
    dist.destroy_process_group()


def _probe(on: bool, calls: int, quick: bool) -> float:
    if quick:  # one process through workers.py (the suite forks it from a warm worker)
        arguments = ["--probe", str(calls), "--recorder", "on" if on else "off"]
        return float(workers.run_workers(__file__, arguments, processes=1)[0]["probe_us"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR")}
    env["OMP_NUM_THREADS"] = "1"
    if on:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    done = subprocess.run(
        [sys.executable, __file__, "--probe", str(calls)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    report = next(line for line in lines if line.startswith("BENCH "))
    return float(json.loads(report[len("BENCH ") :])["probe_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(SIZES))
    parser.add_argument("--probe", type=int)
    parser.add_argument("--recorder", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--sizes", nargs="*", choices=sorted(SIZES))
    parser.add_argument("--generations", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--timed", type=int)
    args = parser.parse_args()
    if args.probe:
        recorder_probe(args.probe, None if args.recorder is None else args.recorder == "on")
        return
    if args.worker:
        worker(args.worker, args.generations, args.rounds, args.timed)
        return
    for size in ["tiny"] if args.quick else args.sizes or list(SIZES):
        generations, rounds, timed = (1, 2, 2) if args.quick else ROUNDS[size]
        arguments = ["--worker", size,
                     "--generations", str(args.generations or generations),
                     "--rounds", str(args.rounds or rounds),
                     "--timed", str(args.timed or timed)]  # fmt: skip
        result = workers.run_workers(__file__, arguments)[0]
        workers.print_step_ratios(size, result, 6)
        print(f"{size:6s} {result['steps']} paired steps per variant")
    calls = 2000 if args.quick else 20000
    off, on = _probe(False, calls, args.quick), _probe(True, calls, args.quick)
    print(
        f"flight recorder: gloo all-reduce CPU {on:.2f} us with vs {off:.2f} us without, "
        f"ratio {on / off:.3f}x"
    )


if __name__ == "__main__":
    main()
