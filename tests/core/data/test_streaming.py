"""Iterable datasets on 2 processes: streams that shard themselves are read once in total,
dispatched batches are read by the main process only, and gather_for_metrics counts every
sample exactly once in every mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from slipstream import Accelerator, DataLoaderConfiguration
from slipstream.data.streaming import can_shard_itself
from tests.distributed import run_distributed

# Five source files of different lengths: 23 samples in all (not a multiple of anything).
FILES = [[*range(0, 7)], [*range(7, 10)], [*range(10, 16)], [*range(16, 20)], [*range(20, 23)]]
TOTAL = 23


class Stream(IterableDataset[torch.Tensor]):
    """Reads its files in order and counts the samples it read."""

    def __init__(self, files: list[list[int]]) -> None:
        self.files = files
        self.read = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for file in self.files:
            for sample in file:
                self.read += 1
                yield torch.tensor(sample)


class ShardableStream(Stream):
    """The documented protocol: ``shard(num_shards, index)`` (here by source file, as a
    Hugging Face ``datasets.IterableDataset`` shards), and ``n_shards``."""

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> Stream:
        part = Stream(self.files[index::num_shards])
        self.parts.append(part)
        return part

    def __init__(self, files: list[list[int]]) -> None:
        super().__init__(files)
        self.parts: list[Stream] = []


def _epoch(kind: str, even_batches: bool = True, drop_last: bool = False) -> dict[str, Any]:
    dispatch = kind == "dispatched"
    acc = Accelerator(
        dataloader_config=DataLoaderConfiguration(
            even_batches=even_batches, dispatch_batches=dispatch
        )
    )
    stream = ShardableStream(FILES) if kind == "sharded" else Stream(FILES)
    loader = acc.prepare(DataLoader(stream, batch_size=2, drop_last=drop_last))
    seen, steps = [], 0
    for batch in loader:
        steps += 1
        seen += acc.gather_for_metrics(batch).tolist()
    read = sum(p.read for p in stream.parts) if kind == "sharded" else stream.read
    return {"seen": sorted(seen), "steps": steps, "read": read}


def _every_mode() -> dict[str, Any]:
    return {
        "replicated": _epoch("replicated"),
        "sharded": _epoch("sharded"),
        "sharded-twice": [_epoch("sharded"), _epoch("sharded")][1],
        "dispatched": _epoch("dispatched"),
        "dispatched-uneven": _epoch("dispatched", even_batches=False),
        "sharded-drop-last": _epoch("sharded", drop_last=True),
    }


def test_every_sample_once_and_how_much_each_process_reads():
    first, second = run_distributed(_every_mode, timeout=180)
    for mode in ("replicated", "sharded", "sharded-twice", "dispatched", "dispatched-uneven"):
        assert first[mode]["seen"] == second[mode]["seen"] == list(range(TOTAL)), mode
        assert first[mode]["steps"] == second[mode]["steps"], f"{mode}: the same steps"
    # Read amplification: every process reads the whole stream ...
    assert first["replicated"]["read"] == second["replicated"]["read"] == TOTAL
    # ... each reads only its part (files 0, 2, 4 and 1, 3): once in total ...
    assert (first["sharded"]["read"], second["sharded"]["read"]) == (16, 7)
    assert first["sharded-twice"]["read"] + second["sharded-twice"]["read"] == TOTAL
    # ... or the main process reads everything and the other nothing.
    assert (first["dispatched"]["read"], second["dispatched"]["read"]) == (TOTAL, 0)
    # drop_last: only whole global batches, while both parts still have samples.
    dropped = first["sharded-drop-last"]
    assert dropped["steps"] == second["sharded-drop-last"]["steps"] == 3
    assert len(dropped["seen"]) == 12


def test_which_datasets_shard_themselves():
    assert can_shard_itself(ShardableStream(FILES), 2)
    assert can_shard_itself(ShardableStream(FILES), 5)
    assert not can_shard_itself(ShardableStream(FILES), 6), "fewer source files than processes"
    assert not can_shard_itself(Stream(FILES), 2)
    assert not can_shard_itself(ShardableStream(FILES), 1)


def _empty_part() -> str:
    acc = Accelerator()
    loader = acc.prepare(DataLoader(ShardableStream([[1, 2, 3], []]), batch_size=2))
    try:
        list(loader)
    except ValueError as error:
        return str(error)
    return "no error"


def test_an_empty_part_is_the_same_clear_error_everywhere():
    messages = run_distributed(_empty_part, timeout=120)
    assert all("process 1's part of the dataset is empty" in m for m in messages)
