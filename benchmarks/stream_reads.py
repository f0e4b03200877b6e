"""Read amplification of iterable datasets: samples each process reads per epoch, for 2 and
4 processes, in each mode slipstream has for a stream:

* ``replicated`` — a stream that cannot shard itself: every process reads all of it and
  keeps its slice (exact, but the total read grows with the number of processes);
* ``sharded`` — a stream that shards itself (``shard(num_shards, index)``, as a Hugging Face
  ``datasets.IterableDataset`` with enough files): each process reads only its part;
* ``dispatched`` — ``dispatch_batches=True``: the main process reads every global batch and
  sends each process its slice.

Every mode must deliver each sample exactly once (checked through ``gather_for_metrics``);
the sharded and dispatched modes must read each sample once in total (ratio 1.00).

    python benchmarks/stream_reads.py
    python benchmarks/stream_reads.py --quick   # 400 samples, 2 processes only (smoke test)

With ``--quick`` the 4-process run is left out: it runs the same code as the 2-process one,
only more ranks, and would start 4 more processes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import workers  # benchmarks/workers.py, beside this script
from torch.utils.data import DataLoader, IterableDataset

MODES = ("replicated", "sharded", "dispatched")


class Files(IterableDataset[torch.Tensor]):
    """A stream of ``files`` source files (ids 0..N-1 in order); counts what it reads."""

    def __init__(self, files: list[range]) -> None:
        self.files = files
        self.read = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for file in self.files:
            for sample in file:
                self.read += 1
                yield torch.tensor([float(sample)])


class ShardedFiles(Files):
    """The same stream, able to shard itself by source file."""

    def __init__(self, files: list[range]) -> None:
        super().__init__(files)
        self.parts: list[Files] = []

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> Files:
        part = Files(self.files[index::num_shards])
        self.parts.append(part)
        return part


def worker(samples: int, files: int) -> None:
    from slipstream import Accelerator, DataLoaderConfiguration, gather_object

    per_file = samples // files
    sources = [range(i * per_file, (i + 1) * per_file) for i in range(files)]
    for mode in MODES:
        accelerator = Accelerator(
            dataloader_config=DataLoaderConfiguration(dispatch_batches=mode == "dispatched")
        )
        stream = ShardedFiles(sources) if mode == "sharded" else Files(sources)
        loader = accelerator.prepare(DataLoader(stream, batch_size=8))
        seen: list[float] = []
        for batch in loader:
            seen += accelerator.gather_for_metrics(batch).flatten().tolist()
        read = sum(p.read for p in stream.parts) if mode == "sharded" else stream.read
        reads = gather_object([read])
        if accelerator.is_main_process:
            total = per_file * files
            workers.report(
                {
                    "mode": mode,
                    "processes": accelerator.num_processes,
                    "reads": reads,
                    "total": total,
                    "exact": sorted(seen) == [float(i) for i in range(total)],
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="400 samples on 2 processes (the 4-process run: same code)",
    )
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--files", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        worker(args.samples, args.files)
        return
    samples = 400 if args.quick else args.samples
    arguments = ["--worker", "--samples", str(samples), "--files", str(args.files)]
    for processes in (2,) if args.quick else (2, 4):
        for result in workers.run_workers(__file__, arguments, processes=processes):
            reads, total = result["reads"], result["total"]
            ratio = sum(reads) / total
            print(
                f"{result['mode']:<10} on {processes} processes: samples read per process "
                f"{reads} of {total}; read amplification ratio {ratio:.2f}x; every sample once: "
                f"{'yes' if result['exact'] else 'NO'}"
            )


if __name__ == "__main__":
    main()
