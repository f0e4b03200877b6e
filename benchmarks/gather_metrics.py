"""``gather_for_metrics`` over an evaluation set versus a raw ``all_gather`` of the same
tensors, on 2 CPU processes (alternating rounds; the median of the per-round ratios).

    python benchmarks/gather_metrics.py
    python benchmarks/gather_metrics.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import workers  # benchmarks/workers.py, beside this script
from torch.utils.data import DataLoader, TensorDataset


def worker(samples: int, rounds: int) -> None:
    from slipstream import Accelerator

    accelerator = Accelerator()
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    loader = accelerator.prepare(DataLoader(data, batch_size=64))
    world = accelerator.num_processes
    times: dict[str, list[float]] = {"gather_for_metrics": [], "all_gather": []}

    def with_slipstream() -> None:
        for batch in loader:
            accelerator.gather_for_metrics(batch)

    def by_hand() -> None:
        for features, labels in loader:  # the same loading work in both variants
            for tensor in (features, labels):
                output = torch.empty(
                    (world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype
                )
                dist.all_gather_into_tensor(output, tensor)

    variants = [("gather_for_metrics", with_slipstream), ("all_gather", by_hand)]
    for round_index in range(rounds):
        for name, run in variants[round_index % 2 :] + variants[: round_index % 2]:
            dist.barrier()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    if accelerator.is_main_process:
        # The ratio within a round (both variants back to back) cancels the machine's drift.
        pairs = zip(times["gather_for_metrics"], times["all_gather"], strict=True)
        result = {k: statistics.median(v) for k, v in times.items()}
        result["ratio"] = statistics.median([a / b for a, b in pairs])
        workers.report(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--samples", type=int, default=20001)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    if args.worker:
        worker(args.samples, args.rounds)
        return
    samples, rounds = (2001, 2) if args.quick else (args.samples, args.rounds)
    arguments = ["--worker", "--samples", str(samples), "--rounds", str(rounds)]
    result = workers.run_workers(__file__, arguments)[0]
    a, b = result["gather_for_metrics"], result["all_gather"]
    print(
        f"gather_for_metrics over {samples} samples vs raw all_gather: {a:.4f}s vs {b:.4f}s  "
        f"ratio {result['ratio']:.3f}x"
    )


if __name__ == "__main__":
    main()
