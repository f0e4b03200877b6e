"""Building a :class:`~slipstream.data.loader.PreparedDataLoader` from the script's
DataLoader: the same dataset, workers and collate function, with a sampler (or a stream
wrapper) that hands this process its share of every global batch.

Example::

    loader = prepare_data_loader(DataLoader(ds, batch_size=16, shuffle=True), state=state)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from ..runtime.state import ProcessState
from .active_loaders import ActiveLoaders
from .iterable import IterableDatasetShard
from .loader import Dispatch, PreparedDataLoader
from .samplers import (
    SeedableRandomSampler,
    ShardedBatchSampler,
    SkipBatchSampler,
    check_shard_arguments,
)
from .stateful import (
    StatefulDatasetShard,
    is_stateful,
    is_stateful_dataloader,
    stateful_loader_class,
)
from .streaming import SelfShardedStream, can_shard_itself

# DataLoader constructor arguments copied from the user's loader when rebuilding it.
_COPIED_ARGUMENTS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class DataLoaderPreparationError(ValueError):
    """A DataLoader cannot be sharded as configured."""


def _copied_arguments(loader: DataLoader[Any]) -> dict[str, Any]:
    accepted = inspect.signature(DataLoader.__init__).parameters
    kwargs = {
        name: getattr(loader, name)
        for name in _COPIED_ARGUMENTS
        if name in accepted and hasattr(loader, name)
    }
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return kwargs


def _agreed_seed(
    generator: torch.Generator | None, state: ProcessState, data_seed: int | None = None
) -> int:
    """A shuffle seed drawn on every rank (same RNG use everywhere), rank 0's value kept;
    ``data_seed`` when given."""
    if data_seed is not None:
        return int(data_seed)
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if state.num_processes > 1:
        from ..runtime.collectives import broadcast

        value = torch.tensor([seed], dtype=torch.int64, device=state.device)
        seed = int(broadcast(value, from_process=0, state=state).item())
    return seed


def _seeded_batch_sampler(
    loader: DataLoader[Any], state: ProcessState, data_seed: int | None = None
) -> Any:
    """The loader's batch sampler, shuffling alike on every rank: a RandomSampler is
    replaced by a seeded one, other samplers get a seeded generator."""
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler and type(sampler) is RandomSampler:
        seeded = SeedableRandomSampler(
            len(sampler.data_source),
            _agreed_seed(sampler.generator, state, data_seed),
            replacement=sampler.replacement,
            num_samples=sampler.num_samples,
        )
        return BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    for owner in (sampler, batch_sampler):
        if owner is not None and hasattr(owner, "generator") and owner.generator is None:
            # A sampler that would draw from the global RNG (WeightedRandomSampler,
            # SubsetRandomSampler, a RandomSampler inside a custom batch sampler, ...) gets
            # its own generator, seeded alike everywhere; _synchronise_generators keeps it in
            # step every pass, and checkpoints save its state.
            generator = torch.Generator()
            generator.manual_seed(_agreed_seed(None, state, data_seed))
            owner.generator = generator
    return batch_sampler


def prepare_data_loader(
    loader: DataLoader[Any],
    *,
    state: ProcessState,
    split_batches: bool = False,
    even_batches: bool = True,
    device_placement: bool = True,
    non_blocking: bool = False,
    active_loaders: ActiveLoaders | None = None,
    dispatch_batches: bool | None = None,
    use_stateful_dataloader: bool = False,
    data_seed: int | None = None,
) -> PreparedDataLoader:
    """Rebuild ``loader`` so this process gets its shard of every global batch.

    Without ``split_batches`` each process loads batches of the script's size (the global
    batch grows with the number of processes); with it each batch is split across processes.
    Under a parallel layout only the data-parallel coordinates count: the processes of one
    tensor-, context- or pipeline-parallel group receive the same samples.

    An ``IterableDataset`` that can shard itself is read in parts, one per process;
    otherwise every process reads the stream and keeps its slice, or, with
    ``dispatch_batches``, the main process reads it and sends each process its slice.

    A torchdata ``StatefulDataLoader``, or any loader with ``use_stateful_dataloader``,
    gives a prepared loader that is also a ``StatefulDataLoader`` (see
    :mod:`slipstream.data.stateful`). ``data_seed`` fixes the shuffle's seed.
    """
    if isinstance(loader, PreparedDataLoader):
        raise DataLoaderPreparationError(
            "this DataLoader was already prepared; pass the original DataLoader to prepare()"
        )
    kwargs = _copied_arguments(loader)
    stateful = use_stateful_dataloader or is_stateful_dataloader(loader)
    loader_class = stateful_loader_class() if stateful else PreparedDataLoader
    device = state.device if device_placement else None
    common: dict[str, Any] = {
        "state": state,
        "device": device,
        "active_loaders": active_loaders,
        "non_blocking": non_blocking,
    }
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if loader.batch_size is None:
            raise DataLoaderPreparationError(
                "cannot shard a DataLoader over an IterableDataset with batch_size=None; "
                "create the DataLoader with batch_size=N so slipstream can split batches"
            )
        if loader.num_workers > 0 and state.data_parallel_size > 1:
            raise DataLoaderPreparationError(
                f"cannot shard an IterableDataset read by worker processes (num_workers="
                f"{loader.num_workers}): each worker would pad and split the stream on its own, "
                "duplicating samples. Use num_workers=0, or a map-style Dataset with workers"
            )
        processes = state.data_parallel_size
        options: dict[str, Any] = {
            "batch_size": loader.batch_size,
            "num_processes": processes,
            "process_index": state.data_parallel_index,
            "split_batches": split_batches,
            "even_batches": even_batches,
            "drop_last": loader.drop_last,
        }
        if dispatch_batches and processes > 1:
            # The main process reads global batches; the others receive their slices.
            check_shard_arguments(processes, 0, split_batches, loader.batch_size)
            per_process = loader.batch_size // processes if split_batches else loader.batch_size
            return loader_class(
                dataset,
                shard=None,
                batch_size=per_process * processes,
                drop_last=False,
                dispatch=Dispatch(per_process, even_batches, loader.drop_last),
                **common,
                **kwargs,
            )
        shard: IterableDatasetShard
        if can_shard_itself(dataset, processes):
            shard = SelfShardedStream(dataset, state=state, **options)  # reads only its part
        elif stateful and is_stateful(dataset):
            shard = StatefulDatasetShard(dataset, **options)  # resumes from its state
        else:
            shard = IterableDatasetShard(dataset, **options)  # reads all, keeps its slice
        per_process = shard.per_process
        return loader_class(
            shard,
            shard=shard,
            batch_size=per_process,
            drop_last=False,
            **common,
            **kwargs,
        )
    if loader.batch_sampler is None:
        raise DataLoaderPreparationError(
            "cannot shard a DataLoader created with batch_size=None and no batch_sampler; "
            "create it with batch_size=N (or pass batch_sampler=...) so slipstream can give "
            "each process whole batches"
        )
    index_sampler = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(index_sampler, DistributedSampler):
        raise DataLoaderPreparationError(
            "this DataLoader already uses a DistributedSampler; slipstream shards data itself: "
            "build the DataLoader with shuffle=True/False (or your own sampler) instead"
        )
    sharded = ShardedBatchSampler(
        _seeded_batch_sampler(loader, state, data_seed),
        num_processes=state.data_parallel_size,
        process_index=state.data_parallel_index,
        split_batches=split_batches,
        even_batches=even_batches,
    )
    return loader_class(dataset, shard=sharded, batch_sampler=sharded, **common, **kwargs)


def skip_first_batches(loader: DataLoader[Any], num_batches: int) -> DataLoader[Any]:
    """A loader whose next pass starts after ``num_batches`` batches (for mid-epoch resume).

    A prepared loader is returned itself, set to skip on its next pass only; later passes are
    complete. Skipped batches of map-style datasets are never loaded.
    """
    if isinstance(loader, PreparedDataLoader):
        loader.skip_next_pass(num_batches)
        return loader
    if loader.batch_sampler is None:
        raise DataLoaderPreparationError(
            "skip_first_batches needs a DataLoader with batch_size=N or a batch_sampler"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise DataLoaderPreparationError(
            "skip_first_batches on an unprepared IterableDataset loader is not supported; "
            "prepare() the DataLoader first"
        )
    return DataLoader(
        loader.dataset,
        batch_sampler=SkipBatchSampler(loader.batch_sampler, num_batches),
        **_copied_arguments(loader),
    )
