"""The pure samplers: every rank's view computed in one process, for many shapes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from torch.utils.data import BatchSampler, SequentialSampler

from slipstream.data import (
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
    SkipBatchSampler,
)

SIZES = [0, 1, 3, 7, 8, 16, 17, 31, 33, 100, 1001]
BATCHES = [1, 2, 4, 16]
WORLDS = [1, 2, 3, 4]


def shards(
    n: int, batch: int, world: int, *, drop_last=False, split=False, even=True
) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        inner = BatchSampler(SequentialSampler(range(n)), batch, drop_last)
        sampler = ShardedBatchSampler(
            inner, num_processes=world, process_index=rank, split_batches=split, even_batches=even
        )
        batches = list(sampler)
        assert len(sampler) == len(batches), (n, batch, world, rank, drop_last, split, even)
        out.append(batches)
    return out


def final_real(n: int, batch: int, world: int, **kw) -> int | None:
    inner = BatchSampler(SequentialSampler(range(n)), batch, kw.get("drop_last", False))
    sampler = ShardedBatchSampler(
        inner,
        num_processes=world,
        process_index=0,
        split_batches=kw.get("split", False),
        even_batches=kw.get("even", True),
    )
    list(sampler)
    return sampler.final_real_samples


@pytest.mark.parametrize("n,batch,world", list(itertools.product(SIZES, BATCHES, WORLDS)))
def test_even_batches_cover_everything_with_duplicates_only_at_the_end(n, batch, world):
    per_rank = shards(n, batch, world)
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1, "every rank takes the same number of steps"
    (step_count,) = steps
    # Every index appears; global step g is the ranks' batches in rank order.
    flat = [i for step in range(step_count) for rank in range(world) for i in per_rank[rank][step]]
    real = final_real(n, batch, world)
    if real is None:
        assert flat == list(range(n))
    else:
        # The final global batch: completed to world x batch, or one process's short batch.
        size = world * batch if world > 1 else real
        full = flat[: len(flat) - size]
        tail = flat[len(flat) - size :]
        assert full + tail[:real] == list(range(n)), "real samples first, in order"
        assert set(tail[real:]) <= set(range(n)), "completion reuses dataset samples"
    if n and world > 1:
        assert all(len(b) == batch for batches in per_rank for b in batches)


@pytest.mark.parametrize("n,batch,world", list(itertools.product(SIZES, BATCHES, WORLDS)))
def test_uneven_batches_have_no_duplicates(n, batch, world):
    per_rank = shards(n, batch, world, even=False)
    everything = Counter(i for batches in per_rank for b in batches for i in b)
    assert sorted(everything) == list(range(n))
    assert set(everything.values()) <= {1}
    # Ranks never differ by more than one step.
    counts = [len(b) for b in per_rank]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("n,batch,world", list(itertools.product(SIZES, BATCHES, WORLDS)))
def test_drop_last_drops_the_incomplete_global_batch(n, batch, world):
    per_rank = shards(n, batch, world, drop_last=True)
    kept = (n // (batch * world)) * batch * world
    flat = [i for step in zip(*per_rank, strict=True) for b in step for i in b]
    assert flat == list(range(kept))


@pytest.mark.parametrize(
    "n,per_process,world,even",
    list(itertools.product(SIZES, [1, 2, 4], WORLDS, [True, False])),
)
def test_split_batches_splits_each_global_batch(n, per_process, world, even):
    batch = per_process * world
    per_rank = shards(n, batch, world, split=True, even=even)
    global_batches = list(BatchSampler(SequentialSampler(range(n)), batch, False))
    for step, expected in enumerate(global_batches):
        parts = [b[step] for b in per_rank if step < len(b)]
        joined = [i for part in parts for i in part]
        real = final_real(n, batch, world, split=True, even=even)
        if len(expected) < batch and even and world > 1:
            assert joined[:real] == expected
            assert len(joined) == batch
        else:
            assert joined == expected


def test_split_batches_requires_divisible_batch_size():
    inner = BatchSampler(SequentialSampler(range(10)), 3, False)
    with pytest.raises(ValueError, match="multiple of 2"):
        ShardedBatchSampler(inner, num_processes=2, process_index=0, split_batches=True)


def test_invalid_rank_is_rejected():
    inner = BatchSampler(SequentialSampler(range(10)), 2, False)
    with pytest.raises(ValueError, match="process_index=2"):
        ShardedBatchSampler(inner, num_processes=2, process_index=2)


class Buckets:
    """A bucketing batch sampler: whole batches of varying size, no batch_size attribute."""

    def __init__(self) -> None:
        self.batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10, 11], [12]]

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def test_custom_batch_sampler_keeps_whole_batches():
    per_rank = [
        list(ShardedBatchSampler(Buckets(), num_processes=2, process_index=r)) for r in range(2)
    ]
    assert per_rank[0][:2] == [[0, 1, 2], [4, 5]]
    assert per_rank[1][:2] == [[3], [6, 7, 8, 9]]
    # The short final batch is completed from the start so both ranks take a full step.
    assert per_rank[0][2] + per_rank[1][2] == [10, 11, 12, 0, 1, 2]


def test_seedable_sampler_depends_only_on_seed_and_epoch():
    a, b = SeedableRandomSampler(50, seed=7), SeedableRandomSampler(50, seed=7)
    assert list(a) == list(b)
    assert sorted(a) == list(range(50))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))
    assert list(SeedableRandomSampler(50, seed=8)) != first


def test_seedable_sampler_num_samples_and_replacement():
    longer = list(SeedableRandomSampler(5, seed=1, num_samples=12))
    assert len(longer) == 12 and Counter(longer[:10]) == Counter(list(range(5)) * 2)
    drawn = list(SeedableRandomSampler(5, seed=1, replacement=True, num_samples=40))
    assert len(drawn) == 40 and set(drawn) <= set(range(5))
    state = SeedableRandomSampler(5, seed=3).state_dict()
    restored = SeedableRandomSampler(5, seed=0)
    restored.load_state_dict(state)
    assert list(restored) == list(SeedableRandomSampler(5, seed=3))


def test_skip_batch_sampler_and_sharded_skip():
    inner = BatchSampler(SequentialSampler(range(10)), 2, False)
    assert list(SkipBatchSampler(inner, 3)) == [[6, 7], [8, 9]]
    assert len(SkipBatchSampler(inner, 3)) == 2
    sharded = ShardedBatchSampler(inner, num_processes=2, process_index=1)
    full = list(sharded)
    sharded.skip_batches = 1
    assert len(sharded) == len(full) - 1
    assert list(sharded) == full[1:]
    assert list(sharded) == full, "the skip applies to one pass only"


def iterable_shards(n, batch, world, **kw):
    out = []
    for rank in range(world):
        shard = IterableDatasetShard(
            range(n), batch_size=batch, num_processes=world, process_index=rank, **kw
        )
        samples = list(shard)
        assert len(shard) == len(samples), (n, batch, world, rank, kw)
        out.append((samples, shard.final_real_samples))
    return out


@pytest.mark.parametrize("n,batch,world", list(itertools.product(SIZES, [1, 2, 4], WORLDS)))
def test_iterable_shard_even(n, batch, world):
    per_rank = iterable_shards(n, batch, world)
    lengths = {len(s) for s, _ in per_rank}
    assert len(lengths) == 1
    steps = -(-n // (batch * world)) if n else 0
    flat = [
        i
        for step in range(steps)
        for samples, _ in per_rank
        for i in samples[step * batch : (step + 1) * batch]
    ]
    real = per_rank[0][1]
    if real is None or world == 1:
        assert flat == list(range(n))
    else:
        cut = len(flat) - batch * world
        assert flat[:cut] + flat[cut : cut + real] == list(range(n))


@pytest.mark.parametrize("n,batch,world", list(itertools.product(SIZES, [1, 2, 4], WORLDS)))
def test_iterable_shard_uneven_and_drop_last(n, batch, world):
    uneven = iterable_shards(n, batch, world, even_batches=False)
    assert sorted(i for s, _ in uneven for i in s) == list(range(n))
    dropped = iterable_shards(n, batch, world, drop_last=True)
    kept = (n // (batch * world)) * batch * world
    assert sorted(i for s, _ in dropped for i in s) == list(range(kept))


class Unsized:
    """A batch sampler without batch_size: the first batch sets the split size."""

    def __iter__(self):
        return iter([[0, 1, 2, 3], [4, 5, 6, 7], [8]])

    def __len__(self) -> int:
        return 3


def test_split_batches_with_a_custom_batch_sampler_keeps_ranks_in_step():
    per_rank = []
    for rank in range(2):
        sampler = ShardedBatchSampler(
            Unsized(), num_processes=2, process_index=rank, split_batches=True
        )
        per_rank.append(list(sampler))
        assert len(sampler) == 3 and sampler.final_real_samples == 1
    assert per_rank[0] == [[0, 1], [4, 5], [8, 0]] and per_rank[1] == [[2, 3], [6, 7], [1, 2]]


class _OpaqueBatchSampler(BatchSampler):
    """torch's BatchSampler under another type: ShardedBatchSampler then iterates it batch
    by batch (the general path) instead of slicing the listed index order."""


@pytest.mark.parametrize(
    "n,batch,world,drop_last,even,skip",
    [
        (n, batch, world, drop_last, even, skip)
        for n, batch, world in itertools.product(SIZES, BATCHES, [2, 3, 4])
        for drop_last, even, skip in [(False, True, 0), (True, True, 0), (False, False, 0),
                                      (False, True, 1), (False, False, 3), (False, True, 99)]
    ],
)  # fmt: skip
def test_sliced_index_order_matches_batch_by_batch_grouping(n, batch, world, drop_last, even, skip):
    for make_sampler in (lambda: SequentialSampler(range(n)), lambda: SeedableRandomSampler(n, 7)):
        for rank in range(world):
            views = []
            for kind in (BatchSampler, _OpaqueBatchSampler):
                sharded = ShardedBatchSampler(
                    kind(make_sampler(), batch, drop_last),
                    num_processes=world,
                    process_index=rank,
                    even_batches=even,
                )
                sharded.skip_batches = skip
                batches = list(sharded)
                views.append((batches, sharded.final_real_samples, sharded.uneven_tail))
            assert views[0] == views[1], (n, batch, world, rank, drop_last, even, skip)
            assert all(type(b) is list for b in views[0][0])


def test_random_sampler_draws_the_same_order_on_both_paths():
    from torch import Generator
    from torch.utils.data import RandomSampler

    views = []
    for kind in (BatchSampler, _OpaqueBatchSampler):
        sampler = RandomSampler(range(37), generator=Generator().manual_seed(3))
        sharded = ShardedBatchSampler(kind(sampler, 4, False), num_processes=2, process_index=1)
        views.append(list(sharded))
    assert views[0] == views[1]


def _random_sampler_order(data, seed: int, **kwargs) -> list[int]:
    from torch import Generator
    from torch.utils.data import RandomSampler

    return list(RandomSampler(data, generator=Generator().manual_seed(seed), **kwargs))


def test_seedable_sampler_takes_accelerates_constructor():
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    data = list(range(23))
    torch.manual_seed(42)  # Accelerate's default seed is torch.initial_seed()
    generator = torch.Generator()
    sampler = SeedableRandomSampler(data_source=data, num_samples=len(data), generator=generator)
    assert isinstance(sampler, RandomSampler) and sampler.seed == sampler.initial_seed == 42
    # A plain DataLoader reshuffles every epoch: epoch e is RandomSampler's order drawn from
    # a generator seeded 42 + e, and the sampler moves to the next epoch after a full pass.
    loader = DataLoader(data, batch_size=5, sampler=sampler)
    for epoch in range(3):
        order = [i for batch in loader for i in batch.tolist()]
        assert order == _random_sampler_order(data, 42 + epoch), epoch
    assert sampler.epoch == 3
    sampler.set_epoch(1)
    assert list(sampler) == _random_sampler_order(data, 43), "set_epoch replays an epoch"
    positional = SeedableRandomSampler(data, True, 40, None, 7)  # data_seed last
    assert positional.seed == 7 and positional.replacement and len(list(positional)) == 40
    assert list(positional) == _random_sampler_order(data, 8, replacement=True, num_samples=40)
    assert SeedableRandomSampler(data, data_seed=5).state_dict() == {"seed": 5, "epoch": 0}


def test_seedable_sampler_keeps_slipstreams_constructor_and_refuses_mixtures():
    assert list(SeedableRandomSampler(6, 3)) == _random_sampler_order(range(6), 3)
    by_keyword = SeedableRandomSampler(length=6, seed=3, num_samples=9)
    assert list(by_keyword) == _random_sampler_order(range(6), 3, num_samples=9)
    assert list(SeedableRandomSampler(0, 1)) == [], "an empty shard is allowed"
    for call, message in [
        (lambda: SeedableRandomSampler(6, 3, 4), "two positional arguments"),
        (lambda: SeedableRandomSampler(6, seed=3, data_seed=4), "disagree"),
        (lambda: SeedableRandomSampler([1, 2], False, None, None, 1, 2), "at most 5"),
        (lambda: SeedableRandomSampler(iter([1]), data_seed=1), "takes a dataset"),
        (lambda: SeedableRandomSampler([1, 2], "yes"), "replacement should be a boolean"),
        (lambda: SeedableRandomSampler([1, 2], num_samples=-1), "num_samples should be"),
        (lambda: SeedableRandomSampler([1, 2], length=2, seed=0), "not both"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            call()
