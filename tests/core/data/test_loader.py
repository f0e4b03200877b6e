"""Prepared dataloaders: real sharding on 2 processes, shuffling, device placement, resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    TensorDataset,
)
from torch.utils.data.distributed import DistributedSampler

from slipstream import Accelerator, set_seed, skip_first_batches
from slipstream.data import DataLoaderPreparationError, PreparedDataLoader
from tests.distributed import run_distributed


def _indices_per_epoch(size, batch, shuffle, split, seed, epochs=2):
    acc = Accelerator(split_batches=split)
    set_seed(seed + acc.process_index)  # deliberately different RNG on each rank
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(size)), batch, shuffle=shuffle))
    passes = [[b[0].tolist() for b in loader] for _ in range(epochs)]
    return {"passes": passes, "len": len(loader)}


def test_shards_are_disjoint_and_lengths_shrink():
    r0, r1 = run_distributed(_indices_per_epoch, 64, 8, False, False, 0)
    assert r0["len"] == r1["len"] == 4  # 8 batches of 8 shared by 2 processes
    first0, first1 = r0["passes"][0], r1["passes"][0]
    assert [len(b) for b in first0] == [8] * 4
    assert sorted(i for b in first0 + first1 for i in b) == list(range(64))
    assert not set(i for b in first0 for i in b) & set(i for b in first1 for i in b)


def test_shuffle_is_identical_across_ranks_and_changes_per_epoch():
    r0, r1 = run_distributed(_indices_per_epoch, 64, 8, True, False, 0)
    for epoch in range(2):
        combined = [
            i
            for s0, s1 in zip(r0["passes"][epoch], r1["passes"][epoch], strict=True)
            for i in s0 + s1
        ]
        # Both ranks used one permutation: together they see each sample once.
        assert sorted(combined) == list(range(64))
    assert r0["passes"][0] != r0["passes"][1], "a new epoch reshuffles"


def test_split_batches_keeps_the_global_batch_size():
    r0, r1 = run_distributed(_indices_per_epoch, 64, 8, False, True, 0)
    assert r0["len"] == r1["len"] == 8
    assert r0["passes"][0][0] == [0, 1, 2, 3] and r1["passes"][0][0] == [4, 5, 6, 7]


def _global_order(world_batch, seed):
    acc = Accelerator()
    set_seed(seed)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(40)), world_batch, shuffle=True))
    return [acc.gather(b[0]).tolist() for b in loader]


def test_two_processes_see_the_global_batches_of_one_process_with_twice_the_batch():
    two = run_distributed(_global_order, 4, 123)[0]
    one = _global_order(8, 123)
    assert two == one


def _set_epoch_and_iterable(size):
    acc = Accelerator()
    set_seed(0)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(size)), 4, shuffle=True))
    loader.set_epoch(5)
    epoch5 = [b[0].tolist() for b in loader]
    loader.set_epoch(5)
    again = [b[0].tolist() for b in loader]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(size))

    stream = acc.prepare(DataLoader(Stream(), batch_size=4))
    flags, samples = [], []
    for batch in stream:
        flags.append(stream.end_of_dataloader)
        samples.append(acc.gather_for_metrics(batch).tolist())
    return {"epoch5": epoch5, "again": again, "flags": flags, "stream": samples}


def test_set_epoch_is_honoured_and_iterable_datasets_are_sharded():
    r0, r1 = run_distributed(_set_epoch_and_iterable, 21)
    assert r0["epoch5"] == r0["again"]
    assert r0["flags"] == [False, False, True] == r1["flags"]
    assert [i for step in r0["stream"] for i in step] == list(range(21))


class RankSeededSampler(Sampler[int]):
    """A user sampler drawing from its own generator (seeded differently on each rank)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self) -> int:
        return self.n


def _custom_sampler():
    acc = Accelerator()
    sampler = RankSeededSampler(32, seed=acc.process_index)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(32)), 4, sampler=sampler))
    inner_random = RandomSampler(range(32))
    custom_batches = BatchSampler(inner_random, 4, False)

    class Batches:
        sampler = inner_random  # exposed, as bucketing samplers usually do

        def __iter__(self):
            return iter(custom_batches)

        def __len__(self):
            return len(custom_batches)

    set_seed(acc.process_index)
    wrapped = acc.prepare(DataLoader(TensorDataset(torch.arange(32)), batch_sampler=Batches()))
    return {
        "generator": [[i for b in loader for i in b[0].tolist()] for _ in range(2)],
        "global_rng": [i for b in wrapped for i in b[0].tolist()],
    }


def _library_samplers():
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    acc = Accelerator()
    set_seed(0, device_specific=True)  # the global RNGs differ across ranks
    data = TensorDataset(torch.arange(16))
    weighted = WeightedRandomSampler(torch.ones(16), 16, replacement=False)
    subset = SubsetRandomSampler(list(range(16)))
    return {
        name: [i for b in acc.prepare(DataLoader(data, 2, sampler=sampler)) for i in b[0].tolist()]
        for name, sampler in (("weighted", weighted), ("subset", subset))
    }


def test_samplers_drawing_from_the_global_rng_are_seeded_alike():
    r0, r1 = run_distributed(_library_samplers)
    for name in ("weighted", "subset"):
        assert sorted(r0[name] + r1[name]) == list(range(16)), name


def _iterable_with_workers():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    acc = Accelerator()
    try:
        acc.prepare(DataLoader(Stream(), batch_size=2, num_workers=2))
    except DataLoaderPreparationError as error:
        return str(error)
    return "prepared"


def test_iterable_datasets_with_workers_are_refused_on_several_processes():
    assert all("num_workers=2" in m for m in run_distributed(_iterable_with_workers))


def test_user_samplers_shuffle_identically_on_every_rank():
    r0, r1 = run_distributed(_custom_sampler)
    for epoch in range(2):
        assert sorted(r0["generator"][epoch] + r1["generator"][epoch]) == list(range(32))
    assert sorted(r0["global_rng"] + r1["global_rng"]) == list(range(32))


def _resume(skip):
    acc = Accelerator()
    set_seed(3)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(48)), 4, shuffle=True))
    full = [b[0].tolist() for b in loader]
    loader.set_epoch(0)
    resumed = [b[0].tolist() for b in acc.skip_first_batches(loader, skip)]
    position = loader.state_dict()
    return {
        "full": full,
        "resumed": resumed,
        "next": [b[0].tolist() for b in loader],
        "pos": position,
    }


def test_skip_first_batches_resumes_mid_epoch_on_two_processes():
    for result in run_distributed(_resume, 2):
        assert result["resumed"] == result["full"][2:]
        assert len(result["next"]) == len(result["full"]), "only one pass is shortened"
        assert result["pos"]["epoch"] == 1 and result["pos"]["batches_yielded"] == 0


@dataclasses.dataclass
class Example:
    features: torch.Tensor
    label: int


def test_batches_are_moved_to_the_device_keeping_structure():
    acc = Accelerator()

    class Structured(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.ones(2) * i, "pair": (torch.tensor(i), "tag")}

    loader = acc.prepare(DataLoader(Structured(), batch_size=2))
    batch = next(iter(loader))
    assert batch["x"].device == acc.device and list(batch["pair"][1]) == ["tag", "tag"]
    assert isinstance(loader, DataLoader) and isinstance(loader, PreparedDataLoader)
    moved = acc.prepare(DataLoader([Example(torch.ones(1), 1)], collate_fn=lambda b: b[0]))
    assert isinstance(next(iter(moved)), Example)


def test_single_process_loader_state_and_skip():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    assert len(loader) == 4
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    assert loader.state_dict()["batches_yielded"] == 2
    state = loader.state_dict()
    fresh = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    fresh.load_state_dict(state)
    assert len(fresh) == 2
    assert [b[0].tolist() for b in fresh] == [[6, 7, 8], [9]]
    plain = DataLoader(TensorDataset(torch.arange(10)), batch_size=3)
    assert [b[0].tolist() for b in skip_first_batches(plain, 3)] == [[9]]


def test_bad_dataloaders_get_clear_errors():
    acc = Accelerator()
    data = TensorDataset(torch.arange(10))
    with pytest.raises(DataLoaderPreparationError, match="batch_size=None"):
        acc.prepare(DataLoader(data, batch_size=None))
    with pytest.raises(DataLoaderPreparationError, match="DistributedSampler"):
        sampler = DistributedSampler(data, num_replicas=2, rank=0)
        acc.prepare(DataLoader(data, batch_size=2, sampler=sampler))
    prepared = acc.prepare(DataLoader(data, batch_size=2))
    assert acc.prepare(prepared) is prepared, "a prepared loader comes back as it is"
    assert acc._dataloaders == [prepared], "and is registered once"
