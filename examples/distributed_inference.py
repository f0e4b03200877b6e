"""Distributed batch inference: each process handles its share of the inputs, the main
process collects every result in order.

    python examples/distributed_inference.py
    slipstream launch --num_processes 2 --cpu examples/distributed_inference.py

Options: --items N (default 101, deliberately not a multiple of the process count).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from slipstream import Accelerator, gather_object


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=101)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)  # the same "model" on every process
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)))
    model.eval()
    requests = [{"id": i, "features": [float(i), i / 2, -i, 1.0]} for i in range(args.items)]

    with accelerator.split_between_processes(requests) as mine, torch.no_grad():
        inputs = torch.tensor([r["features"] for r in mine], device=accelerator.device)
        labels = model(inputs).argmax(dim=1).tolist() if mine else []
        answers = [{"id": r["id"], "label": label} for r, label in zip(mine, labels, strict=True)]

    everything = gather_object(answers)  # one flat list, in process order = input order
    if accelerator.is_main_process:
        assert [a["id"] for a in everything] == list(range(args.items))
        counts = {label: sum(a["label"] == label for a in everything) for label in range(3)}
        print(f"{len(everything)} answers from {accelerator.num_processes} processes: {counts}")


if __name__ == "__main__":
    main()
