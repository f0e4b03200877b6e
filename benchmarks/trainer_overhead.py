"""Training steps per second of the same transformers Trainer run on slipstream and on
Accelerate, side by side.

Runs on 2 CPU processes (torchrun). Each round builds both Trainers afresh (which one goes
first alternates) from the same TrainingArguments, model weights and data, and times each
run's steps from a Trainer callback (the time between the ends of consecutive steps after
the warm-up steps, its median per run; also the main thread's CPU time), so setting up a
Trainer (building the Accelerator, preparing the model) is not counted. The reported ratio
is the median over rounds of slipstream's seconds per step over Accelerate's (below 1:
slipstream's Trainer takes more steps per second). The final weights of the two runs must
be equal in every round.

    python benchmarks/trainer_overhead.py            # tiny and medium Llama
    python benchmarks/trainer_overhead.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import workers  # benchmarks/workers.py, beside this script
from models import llama

# (width, layers, sequence length), 8 sequences per process and step.
SIZES = {"tiny": (32, 2, 32), "medium": (256, 4, 64)}
# (rounds, warm-up steps, timed steps) per round and Trainer.
ROUNDS = {"tiny": (8, 3, 40), "medium": (4, 2, 8)}
VOCABULARY, PER_PROCESS_BATCH = 512, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int, length: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCABULARY, (size, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _run(
    backend: str, size: str, warmup: int, timed: int, out: str
) -> tuple[float, float, list[Any]]:
    """Seconds per step (wall, main-thread CPU) of one Trainer run after ``warmup`` steps,
    and its final weights."""
    import transformers

    from slipstream.integrations.transformers import Trainer

    width, layers, length = SIZES[size]
    stamps: list[tuple[float, float]] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append((time.perf_counter(), time.thread_time()))

    steps = warmup + timed
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=PER_PROCESS_BATCH,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    model = llama(width, layers, VOCABULARY, length)
    data = Tokens(steps * PER_PROCESS_BATCH * dist.get_world_size(), length)
    common = {"model": model, "args": args, "train_dataset": data, "callbacks": [StepClock()]}
    trainer = transformers.Trainer(**common) if backend == "accelerate" else Trainer(**common)
    trainer.train()
    weights = [
        p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()
    ]
    # The median step: a shared machine's pauses land on a few steps, not on the median.
    timed_stamps = stamps[warmup - 1 :]
    walls = [b[0] - a[0] for a, b in itertools.pairwise(timed_stamps)]
    cpus = [b[1] - a[1] for a, b in itertools.pairwise(timed_stamps)]
    return statistics.median(walls), statistics.median(cpus), weights


def worker(size: str, rounds: int, warmup: int, timed: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    seconds: dict[str, list[float]] = {"slipstream": [], "accelerate": []}
    cpu: dict[str, list[float]] = {"slipstream": [], "accelerate": []}
    equal = True
    with tempfile.TemporaryDirectory() as out:
        for index in range(rounds):
            order = ["slipstream", "accelerate"][:: 1 if index % 2 == 0 else -1]
            weights = {}
            for backend in order:
                wall, used, weights[backend] = _run(backend, size, warmup, timed, out)
                seconds[backend].append(wall)
                cpu[backend].append(used)
            same = all(
                torch.equal(a, b)
                for a, b in zip(weights["slipstream"], weights["accelerate"], strict=True)
            )
            equal = equal and workers.on_every_process(same)
    if dist.get_rank() == 0:
        ratios = [s / a for s, a in zip(seconds["slipstream"], seconds["accelerate"], strict=True)]
        workers.report(
            {
                "size": size,
                "rounds": rounds,
                "medians": {k: statistics.median(v) for k, v in seconds.items()},
                "cpu": {k: statistics.median(v) for k, v in cpu.items()},
                "ratio": statistics.median(ratios),
                "range": (min(ratios), max(ratios)),
                "weights_equal": equal,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--timed", type=int)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.warmup, args.timed)
        return
    for size in ["tiny"] if args.quick else list(SIZES):
        rounds, warmup, timed = (1, 1, 3) if args.quick else ROUNDS[size]
        arguments = ["--worker", size,
                     "--rounds", str(args.rounds or rounds),
                     "--warmup", str(args.warmup or warmup),
                     "--timed", str(args.timed or timed)]  # fmt: skip
        result = workers.run_workers(__file__, arguments)[0]
        medians = result["medians"]
        low, high = result["range"]
        same = "equal" if result["weights_equal"] else "DIFFERENT"
        print(
            f"{size:6s} Trainer on slipstream {1 / medians['slipstream']:7.2f} steps/s vs "
            f"accelerate {1 / medians['accelerate']:7.2f} steps/s  ratio {result['ratio']:.3f}x "
            f"(seconds per step; rounds {low:.3f}-{high:.3f} over {result['rounds']}; CPU per "
            f"step {result['cpu']['slipstream'] * 1e3:.2f} vs {result['cpu']['accelerate'] * 1e3:.2f}"
            f" ms; weights {same})"
        )


if __name__ == "__main__":
    main()
