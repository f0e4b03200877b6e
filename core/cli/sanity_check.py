"""The sanity script ``slipstream test`` launches: checks that the configuration trains.

Every process runs each check; results are gathered, the main process prints one line per
check, and every process exits non-zero if any check failed anywhere.

Run directly with ``slipstream launch -m slipstream.cli.sanity_check`` too.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .. import (
    Accelerator,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from .. import set_seed as _set_seed


def check_process_group(acc: Accelerator) -> str:
    total = reduce(torch.tensor([float(acc.process_index)], device=acc.device), "sum")
    expected = acc.num_processes * (acc.num_processes - 1) / 2
    assert total.item() == expected, f"sum of ranks {total.item()} != {expected}"
    return f"{acc.num_processes} process(es) in one group on {acc.device}"


def check_sharding(acc: Accelerator) -> str:
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(1001)), batch_size=8, shuffle=True))
    seen: list[int] = []
    steps = 0
    for (index,) in loader:
        steps += 1
        seen += acc.gather_for_metrics(index).tolist()
    assert sorted(seen) == list(range(1001)), "gather_for_metrics did not return each sample once"
    all_steps = gather_object([steps])
    assert len(set(all_steps)) == 1, f"processes took different numbers of steps: {all_steps}"
    return f"1001 samples sharded, {steps} steps per process, metrics exact"


def check_collectives(acc: Accelerator) -> str:
    rank = acc.process_index
    gathered = gather({"x": torch.full((2,), float(rank), device=acc.device)})["x"]
    assert gathered.tolist() == [float(r) for r in range(acc.num_processes) for _ in range(2)]
    ragged = torch.ones(rank + 1, device=acc.device)
    assert pad_across_processes(ragged).shape[0] == acc.num_processes
    assert gather_object([rank]) == list(range(acc.num_processes))
    assert broadcast_object_list([rank if rank == 0 else None])[0] == 0
    return "gather, gather_object, pad_across_processes, reduce, broadcast"


def check_training(acc: Accelerator) -> str:
    _set_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for _ in range(3):
        for inputs, targets in loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(reduce(loss.detach(), "mean").item())
    assert losses[-1] < losses[0] / 2, f"loss went from {losses[0]:.3f} to {losses[-1]:.3f}"
    weights = acc.get_state_dict(model)
    if acc.is_main_process:
        checksum = float(sum(v.float().sum() for v in weights.values()))
        assert torch.isfinite(torch.tensor(checksum)), "weights are not finite"
    with tempfile.TemporaryDirectory() as folder:
        shared = broadcast_object_list([folder])[0]
        if acc.state.num_local_processes == acc.num_processes:  # one machine: shared disk
            acc.save_state(f"{shared}/ckpt")
            acc.load_state(f"{shared}/ckpt")
        acc.wait_for_everyone()
    return f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, save/load ok"


CHECKS: list[tuple[str, Callable[[Accelerator], str]]] = [
    ("process group", check_process_group),
    ("sharded data", check_sharding),
    ("collectives", check_collectives),
    ("training", check_training),
]


def main() -> int:
    acc = Accelerator()
    failures = 0
    checks: Any = CHECKS
    if acc.is_main_process:
        try:
            from tqdm.auto import tqdm

            from ..runtime.progress import bar_options

            options = bar_options({"desc": "sanity checks", "unit": "check", "leave": False})
            checks = tqdm(CHECKS, **options)
        except ImportError:
            pass
    for name, check in checks:
        try:
            detail, ok = check(acc), True
        except Exception as error:
            detail, ok = f"{type(error).__name__}: {error}", False
            if acc.is_main_process:
                traceback.print_exc()
        everyone = gather_object([(ok, detail)])
        passed = all(result for result, _ in everyone)
        failures += not passed
        shown = detail if passed else "; ".join(d for r, d in everyone if not r)
        acc.print(f"{'PASS' if passed else 'FAIL'}  {name}: {shown}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
