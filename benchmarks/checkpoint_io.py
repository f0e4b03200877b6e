"""save_state / load_state / save_model throughput versus plain torch.save / torch.load.

The same tensors (a model's weights and its AdamW state) are written to the same disk by
both, alternately, several times; medians and their ratio are printed. Run:

    python benchmarks/checkpoint_io.py            # ~200 MB of weights
    python benchmarks/checkpoint_io.py --quick    # a few MB (smoke test)

``--quick`` measures in one process started through ``workers.run_workers`` (the suite forks
it from a warm worker) instead of in this one.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from slipstream import Accelerator


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # creates the optimizer state (two tensors per parameter)
    return model, optimizer


def timed(action) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def one_round(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    slipstream_first: bool,
) -> dict[str, float]:
    """One repetition of every measurement, plain PyTorch and slipstream back to back (which
    goes first alternates between rounds: the second writer can meet the first's writeback)."""
    folder.mkdir()
    inner = accelerator.unwrap_model(model)
    plain, weights = folder / "plain.pt", folder / "weights.pt"

    def plain_load() -> None:
        loaded = torch.load(plain, weights_only=True)
        inner.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    both = {"model": inner.state_dict(), "optimizer": optimizer.state_dict()}
    pairs = [
        (
            ("torch_save", lambda: torch.save(both, plain)),
            ("save_state", lambda: accelerator.save_state(str(folder / "ck"))),
        ),
        (
            ("torch_save_weights", lambda: torch.save(inner.state_dict(), weights)),
            ("save_model", lambda: accelerator.save_model(model, str(folder / "m"))),
        ),
    ]
    times: dict[str, float] = {}
    for plain_step, slipstream_step in pairs:
        for name, action in (
            (slipstream_step, plain_step) if slipstream_first else (plain_step, slipstream_step)
        ):
            times[name] = timed(action)
    times["async_blocking"] = timed(
        lambda: accelerator.save_state(str(folder / "ck2"), async_save=True)
    )
    accelerator.wait_for_checkpoint()
    # Loads alternate three times each (both files are in the page cache by then).
    loads: dict[str, list[float]] = {"torch_load": [], "load_state": []}
    for _ in range(3):
        loads["torch_load"].append(timed(plain_load))
        loads["load_state"].append(timed(lambda: accelerator.load_state(str(folder / "ck"))))
    times.update({name: statistics.median(values) for name, values in loads.items()})
    shutil.rmtree(folder)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a few MB, 2 repeats, in a worker (smoke test)"
    )
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    width, layers = (256, 4) if args.quick else (2048, 12)  # ~200 MB of fp32 weights
    repeats = 2 if args.quick else args.repeats
    if args.quick and not args.worker:
        import workers  # benchmarks/workers.py, beside this script

        [report] = workers.run_workers(__file__, ["--quick", "--worker"], processes=1)
        _print(report["megabytes"], repeats, report["results"])
        return
    megabytes, results = measure(width, layers, repeats)
    if args.worker:
        import workers

        workers.report({"megabytes": megabytes, "results": results})
        return
    _print(megabytes, repeats, results)


def measure(width: int, layers: int, repeats: int) -> tuple[float, dict[str, list[float]]]:
    """The weights' MB and each measurement's seconds per repeat."""
    accelerator = Accelerator()
    model, optimizer = build(width, layers)
    model, optimizer = accelerator.prepare(model, optimizer)
    megabytes = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    root = Path(tempfile.mkdtemp(prefix="slipstream-bench-"))
    results: dict[str, list[float]] = {
        k: []
        for k in (
            "torch_save",
            "save_state",
            "save_model",
            "torch_load",
            "load_state",
            "torch_save_weights",
            "async_blocking",
        )
    }
    try:
        for i in range(repeats):
            round_times = one_round(accelerator, model, optimizer, root / str(i), i % 2 == 1)
            for name, seconds in round_times.items():
                results[name].append(seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return megabytes, results


def _print(megabytes: float, repeats: int, results: dict[str, list[float]]) -> None:
    median = {k: statistics.median(v) for k, v in results.items()}

    def paired_ratio(name: str, base: str) -> float:
        """Median over rounds of the ratio within a round (cancels the machine's drift)."""
        return statistics.median(a / b for a, b in zip(results[name], results[base], strict=True))

    print(
        f"weights: {megabytes:.0f} MB (+ AdamW state {2 * megabytes:.0f} MB), {repeats} repeats, medians"
    )
    for name, base, label in (
        ("save_state", "torch_save", "save_state vs torch.save(model+optimizer)"),
        ("load_state", "torch_load", "load_state vs torch.load + load_state_dict (both)"),
        ("save_model", "torch_save_weights", "save_model (safetensors) vs torch.save(weights)"),
        ("async_blocking", "save_state", "save_state(async_save=True) blocking vs synchronous"),
    ):
        print(
            f"{label:52s} {median[name]:7.3f}s vs {median[base]:7.3f}s  ratio {paired_ratio(name, base):.2f}x"
        )


if __name__ == "__main__":
    main()
