"""One process of ``slipstream plan --verify``: train a few steps of one layout and report
this process's peak memory and step times (started by :mod:`slipstream.planning.verify`
under torchrun, one process per device of the layout).

What "peak memory" means here (and what the planner predicts for CPU processes): the
resident set's high-water mark during training (``VmHWM``, reset after ``prepare``, with
samples taken between the calls) above the process's resident size just before the model
was built. Before that baseline each process has imported and run everything the step
needs once on a one-layer copy of the model (modules, autograd and optimizer code paths)
and made its first collective, so the difference is what the model, its gradients,
optimizer state, activations and the engine's buffers hold. glibc is told to hand large
freed blocks back (``MALLOC_MMAP_THRESHOLD_``), so the figure follows live tensors.

Run by hand::

    torchrun --nproc_per_node 4 -m slipstream.planning.verify_worker spec.json
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from typing import Any

PREFIX = "SLIPSTREAM_VERIFY "


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _batch(source_kind: str, vocabulary: int, samples: int, seq_len: int, step: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocabulary, (samples, seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids}


def _warm_up(source: Any, layout: Any, seq_len: int) -> None:
    """Run one step of a one-layer copy, so imports and first-call allocations happen
    before the baseline (they are the process's, not the model's)."""
    import torch
    import torch.distributed.fsdp
    import torch.distributed.tensor

    if layout.pp > 1:
        import torch.distributed.pipelining
    if layout.engine.startswith("zero"):
        import deepspeed  # noqa: F401
    model = source.build("cpu", layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocabulary = int(source.config.get("vocab_size", 2))
    loss = model(**_batch(source.kind, vocabulary, 1, seq_len, 0)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    del model, optimizer, loss
    gc.collect()


def run(spec: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Train ``spec``'s layout; rank 0 returns every rank's report (others None)."""
    import torch
    import torch.distributed as dist

    from ..accelerator import Accelerator
    from ..runtime.collectives import gather_object
    from .layouts import Layout
    from .model_source import ModelSource

    torch.set_num_threads(1)
    source = ModelSource.from_dict(spec["model"])
    layout = Layout.from_dict(spec["layout"])
    layers, seq_len, steps = spec.get("layers"), int(spec["seq_len"]), int(spec["steps"])
    _warm_up(source, layout, seq_len)
    kwargs = layout.accelerator_kwargs(
        spec.get("bucket_elements"), tuple(spec.get("wrap_classes") or ())
    )
    accelerator = Accelerator(**kwargs)
    dist.all_reduce(torch.ones(1024))  # the first collective's buffers are the process's
    dist.barrier()
    gc.collect()
    baseline = _status_mib("VmRSS")
    torch.manual_seed(0)
    model = source.build("cpu", layers=layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    gc.collect()
    prepared = _status_mib("VmRSS") - baseline
    vocabulary = int(source.config.get("vocab_size", 2))
    per_call = layout.micro_batch * (layout.pp_microbatches if layout.pp > 1 else 1)
    calls = 1 if layout.pp > 1 else layout.accumulation
    times: list[float] = []
    # The peaks of the two halves of a step, each its high-water mark (reset before it) or
    # the resident size sampled right after it, whichever is larger.
    phases = {"forward_backward": prepared, "optimizer": prepared}

    def mark(phase: str) -> None:
        now = max(_status_mib("VmHWM"), _status_mib("VmRSS")) - baseline
        phases[phase] = max(phases[phase], now)
        _reset_high_water_mark()

    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        for call in range(calls):
            batch = _batch(source.kind, vocabulary, per_call, seq_len, step * calls + call)
            with accelerator.accumulate(model):
                _reset_high_water_mark()
                accelerator.forward_backward(model, batch)
                mark("forward_backward")
                optimizer.step()
                optimizer.zero_grad()
                mark("optimizer")
        dist.barrier()
        times.append(time.perf_counter() - start)
    peak = max(phases.values())
    timed = times[1:] or times  # the first step pays for lazy set-up (optimizer state)
    report = {
        "rank": dist.get_rank(),
        "peak_mib": peak,
        "prepared_mib": prepared,
        "phases_mib": phases,
        "baseline_mib": baseline,
        "step_seconds": statistics.median(timed),
        "step_times": times,
    }
    reports = gather_object([report])
    return reports if accelerator.is_main_process else None


def main(argv: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    with open(arguments[0]) as handle:
        spec = json.load(handle)
    reports = run(spec)
    if reports is not None:
        print(PREFIX + json.dumps(reports), flush=True)


if __name__ == "__main__":
    main()
