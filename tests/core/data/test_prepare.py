"""Preparing loaders as Accelerate does: the script's generator decides the order, a sampler
that yields batches, Accelerate's prepare_data_loader and its loader classes; on 2 real
processes, against plain one-process PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    default_collate,
)

from slipstream import Accelerator, set_seed
from slipstream.data import (
    DataLoaderDispatcher,
    DataLoaderShard,
    PreparedDataLoader,
    SeedableRandomSampler,
    prepare_data_loader,
)
from slipstream.utils import RNGType
from tests.distributed import run_distributed


def _plain_order(size: int, batch: int, seed: int, epochs: int) -> list[list[list[int]]]:
    """What one process with the global batch size draws from a generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(torch.arange(size)), batch, shuffle=True, generator=generator)
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def _generator_order(size: int, batch: int, split: bool, epochs: int) -> list[list[list[int]]]:
    acc = Accelerator(split_batches=split)
    torch.manual_seed(100 + acc.process_index)  # the global RNG plays no part
    # Seeded apart on purpose: rank 0's generator is the one that counts, as in Accelerate.
    generator = torch.Generator().manual_seed(42 if acc.is_main_process else 7)
    loader = DataLoader(TensorDataset(torch.arange(size)), batch, shuffle=True, generator=generator)
    loader = acc.prepare(loader)
    return [[acc.gather_for_metrics(b[0]).tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("size", [40, 44], ids=["whole-batches", "short-tail"])
@pytest.mark.parametrize("split", [False, True], ids=["per-process", "split"])
def test_the_scripts_generator_orders_the_global_batches_as_one_process(size, split):
    # 2 processes x 4 (or a batch of 8 split in two) see what one process with 8 sees.
    per_process = 8 if split else 4
    results = run_distributed(_generator_order, size, per_process, split, 3)
    assert results[0] == results[1] == _plain_order(size, 8, 42, 3)


class Indexed(Dataset):
    """Fetches a whole list of indices at once (a sampler that yields batches)."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, indices: list[int]) -> list[dict[str, int]]:
        return [{"index": i} for i in indices]


def _batch_sampler_as_sampler(with_generator: bool) -> dict:
    acc = Accelerator()
    torch.manual_seed(acc.process_index)  # a different global RNG on each rank

    def batches() -> BatchSampler:
        generator = torch.Generator().manual_seed(5) if with_generator else None
        return BatchSampler(RandomSampler(Indexed(), generator=generator), 4, drop_last=False)

    plain = DataLoader(Indexed(), sampler=batches(), batch_size=None, collate_fn=default_collate)
    loader = acc.prepare(
        DataLoader(
            Indexed(),
            sampler=batches(),
            batch_size=None,
            collate_fn=default_collate,
        )
    )
    seen, flags = [], []
    for batch in loader:
        flags.append(loader.end_of_dataloader)
        seen.append(acc.gather_for_metrics(batch["index"]).tolist())
    return {
        "seen": seen,
        "flags": flags,
        "len": len(loader),
        "total_batch_size": loader.total_batch_size,
        "plain": [b["index"].tolist() for b in plain] if with_generator else None,
    }


@pytest.mark.parametrize("with_generator", [False, True], ids=["seeded", "generator"])
def test_a_sampler_that_yields_batches_is_sharded_as_a_batch_sampler(with_generator):
    # (Worker processes cannot start inside the test ranks, which are daemons.)
    r0, r1 = run_distributed(_batch_sampler_as_sampler, with_generator)
    assert r0["seen"] == r1["seen"] and r0["flags"] == r1["flags"] == [False, False, True]
    everything = [i for step in r0["seen"] for i in step]
    assert sorted(everything) == list(range(22)), "each sample exactly once, no duplicates"
    assert r0["len"] == 3 and r0["total_batch_size"] == 8
    if with_generator:
        # Global batch k is plain batches 2k and 2k+1 (the order drawn from rank 0's generator).
        plain = r0["plain"]
        assert [a + b for a, b in zip(plain[::2], plain[1::2], strict=True)] == r0["seen"]


def _resume(save_after: int, via_checkpoint: str | None) -> dict:
    """Batches of epochs 1-2 when the loader's position is saved after ``save_after``
    batches of epoch 1 and restored into a fresh loader whose generator was seeded apart."""

    def build(seed: int):
        acc = Accelerator()
        generator = torch.Generator().manual_seed(seed)
        data = TensorDataset(torch.arange(36))
        return acc, acc.prepare(DataLoader(data, 4, shuffle=True, generator=generator))

    acc, loader = build(42)
    [b[0].tolist() for b in loader]  # epoch 0
    straight, saved = [], None
    for epoch in range(1, 3):
        for step, batch in enumerate(loader):
            if epoch == 1 and step == save_after:
                saved = loader.state_dict()
                if via_checkpoint:
                    acc.save_state(via_checkpoint)
            straight.append((epoch, acc.gather(batch[0]).tolist()))
        if epoch == 1 and save_after == len(loader):
            saved = loader.state_dict()  # an epoch boundary
            if via_checkpoint:
                acc.save_state(via_checkpoint)
    acc, fresh = build(0)
    if via_checkpoint:
        acc.load_state(via_checkpoint)
    else:
        fresh.load_state_dict(saved)
    resumed = []
    while fresh.epoch < 3:
        epoch = fresh.epoch
        resumed += [(epoch, acc.gather(b[0]).tolist()) for b in fresh]
    return {"straight": straight, "resumed": resumed, "saved": saved}


@pytest.mark.parametrize("save_after", [2, 5], ids=["mid-epoch", "epoch-boundary"])
def test_resume_with_the_scripts_generator_is_exact(save_after):
    # 36 samples in global batches of 8: 5 steps per epoch. Saved at step k, batch k counts
    # as consumed (Accelerate's convention); at the boundary the whole epoch is.
    consumed = save_after + 1 if save_after < 5 else 5
    for result in run_distributed(_resume, save_after, None):
        assert result["resumed"] == result["straight"][consumed:]
        assert result["saved"]["generators"][0] is not None, "the generator is in the position"


def test_resume_with_the_scripts_generator_through_save_state(tmp_path):
    for result in run_distributed(_resume, 3, str(tmp_path / "checkpoint")):
        assert result["resumed"] == result["straight"][4:]


# -- Accelerate's prepare_data_loader -------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10).tolist())


def _accelerate_signature() -> dict:
    from slipstream import PartialState

    state = PartialState()
    length = 32 * state.num_processes
    positional = prepare_data_loader(
        DataLoader(range(length), batch_size=8),
        state.device,
        state.num_processes,
        state.process_index,
        put_on_device=True,
    )
    keyword = prepare_data_loader(
        dataloader=DataLoader(list(range(10)), batch_size=1, shuffle=True),
        use_seedable_sampler=True,
    )
    dispatched = prepare_data_loader(
        DataLoader(Stream(), batch_size=4),
        state.device,
        put_on_device=True,
        dispatch_batches=True,
        slice_fn_for_dispatch=lambda batch, cut, process_index, num_processes: batch[cut] * 10,
    )
    # rng_types=["torch"]: every pass starts from the main process's global RNG.
    torch.manual_seed(state.process_index)
    synced = prepare_data_loader(
        DataLoader(range(8), batch_size=2), rng_types=["torch", "generator"]
    )
    draws = []
    for _ in synced:
        draws.append(torch.rand(1).item())
        break
    errors = []
    for call in (
        lambda: prepare_data_loader(DataLoader(range(4)), num_processes=3),
        lambda: prepare_data_loader(DataLoader(range(4)), process_index=1 - state.process_index),
    ):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    return {
        "positional": [b.tolist() for b in positional],
        "placed": positional.device,
        "unplaced": keyword.device,
        "shard": isinstance(positional, DataLoaderShard)
        and not isinstance(positional, DataLoaderDispatcher),
        "seedable": isinstance(keyword.batch_sampler.batch_sampler.sampler, SeedableRandomSampler),
        "dispatcher": isinstance(dispatched, DataLoaderDispatcher),
        "dispatched": [b.tolist() for b in dispatched],
        "again": prepare_data_loader(positional) is positional,
        "draws": draws,
        "errors": errors,
    }


def test_prepare_data_loader_takes_accelerates_arguments():
    r0, r1 = run_distributed(_accelerate_signature)
    combined = [i for a, b in zip(r0["positional"], r1["positional"], strict=True) for i in a + b]
    assert combined == list(range(64))
    for result in (r0, r1):
        assert result["placed"] == torch.device("cpu") and result["unplaced"] is None
        assert result["shard"] and result["seedable"] and result["dispatcher"] and result["again"]
        assert len(result["errors"]) == 2
        assert all("does not describe this process" in e for e in result["errors"])
    # The main process read 0..9 in global batches of 8; the slice function cut (and scaled)
    # each process's rows; the short last batch was completed from the first.
    assert r0["dispatched"] == [[0, 10, 20, 30], [80, 90, 0, 10]]
    assert r1["dispatched"] == [[40, 50, 60, 70], [20, 30, 40, 50]]
    assert r0["draws"] == r1["draws"]


def test_prepare_data_loader_on_one_process():
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(6)), batch_size=4))
    assert isinstance(loader, DataLoaderShard) and isinstance(loader, PreparedDataLoader)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]
    stream = prepare_data_loader(DataLoader(Stream(), batch_size=4), dispatch_batches=True)
    assert isinstance(stream, DataLoaderShard), "one process has nothing to dispatch"
    # A job of one process may build another layout's shard (Accelerate's tests do).
    other = prepare_data_loader(DataLoader(range(6), batch_size=1), None, 2, 1)
    assert [b.tolist() for b in other] == [[1], [3], [5]]
    with pytest.raises(ValueError, match="does not describe this process"):
        prepare_data_loader(DataLoader(range(4)), None, 2, 2)
    items = prepare_data_loader(DataLoader(Stream(), batch_size=None))  # items are batches
    assert list(items) == list(range(10))
    kinds = [RNGType.TORCH, RNGType.GENERATOR]  # "generator": the shuffle's, always in step
    assert prepare_data_loader(DataLoader(range(4)), rng_types=kinds).rng_types == ["torch"]
    set_seed(3)
    shuffled = prepare_data_loader(DataLoader(range(8), batch_size=4, shuffle=True))
    assert sorted(i for b in shuffled for i in b.tolist()) == list(range(8))


def test_shuffle_without_a_generator_is_accelerates_for_the_same_seed():
    # Accelerate seeds its sampler with torch.initial_seed() (what set_seed sets): the same
    # order here, epoch after epoch, and preparing draws nothing from torch's RNG.
    data_loader = pytest.importorskip("accelerate.data_loader")
    set_seed(5)
    theirs = data_loader.SeedableRandomSampler(range(12))
    expected = []
    for epoch in range(2):
        theirs.set_epoch(epoch)
        expected.append(list(theirs))
    set_seed(5)
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True))
    assert torch.initial_seed() == 5 and torch.randint(0, 10**6, ()) == _first_draw(5)
    ours = [[i for (b,) in loader for i in b.tolist()] for _ in range(2)]
    assert ours == expected


def _first_draw(seed: int) -> torch.Tensor:
    return torch.randint(0, 10**6, (), generator=torch.Generator().manual_seed(seed))
