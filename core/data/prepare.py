"""Building a :class:`~slipstream.data.loader.PreparedDataLoader` from the script's
DataLoader: the same dataset, workers and collate function, with a sampler (or a stream
wrapper) that hands this process its share of every global batch.

:func:`prepare_data_loader` is Accelerate's function (same arguments, the current process
state); the Accelerator and adapters call :func:`shard_data_loader` with their state.

Example::

    loader = prepare_data_loader(DataLoader(ds, batch_size=16, shuffle=True))
    loader = shard_data_loader(DataLoader(ds, batch_size=16, shuffle=True), state=state)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from ..runtime.state import ProcessState, current_state
from .active_loaders import ActiveLoaders
from .iterable import IterableDatasetShard, ShardedIterable
from .loader import Dispatch, PreparedDataLoader
from .named_loaders import DataLoaderDispatcher, DataLoaderShard
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


def _agreed_seed(state: ProcessState, data_seed: int | None = None) -> int:
    """``data_seed`` when given, else ``torch.initial_seed()`` (``set_seed`` decides it, and
    Accelerate seeds its shuffles the same way, so both draw the same order), rank 0's
    value kept. Nothing is drawn from torch's RNG: preparing a loader leaves it as it was."""
    if data_seed is not None:
        return int(data_seed)
    return _main_process_seed(torch.initial_seed(), state)


def _main_process_seed(seed: int, state: ProcessState) -> int:
    """Rank 0's ``seed``, sent as two 32-bit halves (torch's seeds go up to 2**64 - 1)."""
    if state.num_processes == 1:
        return seed
    from ..runtime.collectives import broadcast

    halves = torch.tensor([seed >> 32, seed & 0xFFFFFFFF], dtype=torch.int64, device=state.device)
    high, low = broadcast(halves, from_process=0, state=state).tolist()
    return (int(high) << 32) | int(low)


def _agree_on_seed(sampler: SeedableRandomSampler, state: ProcessState) -> None:
    """Give a sampler the script built rank 0's seed (Accelerate's default seed is
    ``torch.initial_seed()``, which differs across ranks seeded apart)."""
    sampler.seed = _main_process_seed(sampler.seed, state)


def _seeded_batch_sampler(
    batch_sampler: Any, state: ProcessState, data_seed: int | None = None
) -> Any:
    """The loader's batch sampler, shuffling alike on every rank.

    * A ``RandomSampler`` with the script's own generator keeps it: the order is drawn from
      that generator, as plain PyTorch draws it, and the prepared loader sets the generator
      to rank 0's state at the start of every pass (and checkpoints it). So the global
      batches are those a one-process DataLoader with the global batch size draws from the
      same seed, epoch after epoch.
    * A ``RandomSampler`` without one (or any, with ``data_seed``) becomes a
      :class:`SeedableRandomSampler` seeded with ``torch.initial_seed()`` (``set_seed``
      decides it; Accelerate's seed, so the order is Accelerate's), rank 0's kept, or with
      ``data_seed``: its order depends only on the seed and the epoch, so ``set_epoch(e)``
      replays epoch ``e``.
    * A :class:`SeedableRandomSampler` the script built is kept, with rank 0's seed.
    * Other samplers that draw from the global RNG get a generator seeded alike.
    """
    sampler = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler and type(sampler) is RandomSampler:
        if sampler.generator is not None and data_seed is None:
            return batch_sampler
        seeded = SeedableRandomSampler(
            len(sampler.data_source),
            _agreed_seed(state, data_seed),
            replacement=sampler.replacement,
            num_samples=sampler.num_samples,
        )
        return BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last)
    owners = [batch_sampler]
    if isinstance(sampler, SeedableRandomSampler):
        _agree_on_seed(sampler, state)
    else:
        owners.insert(0, sampler)
    for owner in owners:
        if owner is not None and hasattr(owner, "generator") and owner.generator is None:
            # A sampler that would draw from the global RNG (WeightedRandomSampler,
            # SubsetRandomSampler, a RandomSampler inside a custom batch sampler, ...) gets
            # its own generator, seeded alike everywhere; _synchronise_generators keeps it in
            # step every pass, and checkpoints save its state.
            generator = torch.Generator()
            generator.manual_seed(_agreed_seed(state, data_seed))
            owner.generator = generator
    return batch_sampler


def shard_data_loader(
    loader: DataLoader[Any],
    *,
    state: ProcessState,
    split_batches: bool = False,
    even_batches: bool = True,
    device_placement: bool = True,
    device: torch.device | None = None,
    non_blocking: bool = False,
    active_loaders: ActiveLoaders | None = None,
    dispatch_batches: bool | None = None,
    use_stateful_dataloader: bool = False,
    data_seed: int | None = None,
    rng_types: Sequence[str] | None = None,
    slice_fn: Callable[..., Any] | None = None,
    layout: tuple[int, int] | None = None,
) -> PreparedDataLoader:
    """Rebuild ``loader`` so this process (of ``state``) gets its shard of every global batch.

    Without ``split_batches`` each process loads batches of the script's size (the global
    batch grows with the number of processes); with it each batch is split across processes.
    Under a parallel layout only the data-parallel coordinates count: the processes of one
    tensor-, context- or pipeline-parallel group receive the same samples.

    An ``IterableDataset`` that can shard itself is read in parts, one per process;
    otherwise every process reads the stream and keeps its slice, or, with
    ``dispatch_batches``, the main process reads it and sends each process its slice
    (``slice_fn`` cuts the slices, see :func:`~slipstream.data.dispatch.dispatched_batches`).

    A torchdata ``StatefulDataLoader``, or any loader with ``use_stateful_dataloader``,
    gives a prepared loader that is also a ``StatefulDataLoader`` (see
    :mod:`slipstream.data.stateful`). ``data_seed`` fixes the shuffle's seed (see
    :func:`_seeded_batch_sampler` for how shuffles are kept alike). Batches go to ``device``
    (default the state's) unless ``device_placement`` is False; ``rng_types`` names global
    RNGs set to the main process's state at the start of every pass. ``layout`` =
    ``(num_processes, process_index)`` builds the shard of another layout than the job's
    (a job of one process only: Accelerate's ``prepare_data_loader(num_processes=2)``).

    Example::

        loader = shard_data_loader(DataLoader(ds, batch_size=16, shuffle=True), state=state)
    """
    if isinstance(loader, PreparedDataLoader):
        raise DataLoaderPreparationError(
            "this DataLoader was already prepared; pass the original DataLoader to prepare()"
        )
    kwargs = _copied_arguments(loader)
    stateful = use_stateful_dataloader or is_stateful_dataloader(loader)
    dataset = loader.dataset
    processes, index = layout or (state.data_parallel_size, state.data_parallel_index)
    dispatching = bool(dispatch_batches) and processes > 1 and isinstance(dataset, IterableDataset)
    base = DataLoaderDispatcher if dispatching else DataLoaderShard
    loader_class = stateful_loader_class(base) if stateful else base
    common: dict[str, Any] = {
        "state": state,
        "device": (device if device is not None else state.device) if device_placement else None,
        "active_loaders": active_loaders,
        "non_blocking": non_blocking,
        "rng_types": rng_types,
    }
    if isinstance(dataset, IterableDataset):
        if loader.batch_size is None and processes == 1:
            # Items are whole batches already and one process reads them all.
            return loader_class(dataset, batch_size=None, **common, **kwargs)
        if loader.batch_size is None:
            raise DataLoaderPreparationError(
                "cannot shard a DataLoader over an IterableDataset with batch_size=None; "
                "create the DataLoader with batch_size=N so slipstream can split batches"
            )
        if loader.num_workers > 0 and processes > 1:
            raise DataLoaderPreparationError(
                f"cannot shard an IterableDataset read by worker processes (num_workers="
                f"{loader.num_workers}): each worker would pad and split the stream on its own, "
                "duplicating samples. Use num_workers=0, or a map-style Dataset with workers"
            )
        options: dict[str, Any] = {
            "batch_size": loader.batch_size,
            "num_processes": processes,
            "process_index": index,
            "split_batches": split_batches,
            "even_batches": even_batches,
            "drop_last": loader.drop_last,
        }
        if dispatching:
            # The main process reads global batches; the others receive their slices.
            check_shard_arguments(processes, 0, split_batches, loader.batch_size)
            per_process = loader.batch_size // processes if split_batches else loader.batch_size
            return loader_class(
                dataset,
                shard=None,
                batch_size=per_process * processes,
                drop_last=False,
                dispatch=Dispatch(per_process, even_batches, loader.drop_last, slice_fn),
                **common,
                **kwargs,
            )
        shard: ShardedIterable
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
    batch_sampler = loader.batch_sampler
    # DataLoader(ds, sampler=BatchSampler(...), batch_size=None): every item the sampler
    # yields is a list of indices the dataset fetches at once. It is sharded like a batch
    # sampler and stays the loader's sampler, so the dataset still gets whole lists.
    sampler_yields_batches = batch_sampler is None and isinstance(loader.sampler, BatchSampler)
    if sampler_yields_batches:
        batch_sampler = loader.sampler
    if batch_sampler is None:
        raise DataLoaderPreparationError(
            "cannot shard a DataLoader created with batch_size=None and no batch_sampler; "
            "create it with batch_size=N, batch_sampler=..., or sampler=BatchSampler(...) so "
            "slipstream can give each process whole batches"
        )
    index_sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(index_sampler, DistributedSampler):
        raise DataLoaderPreparationError(
            "this DataLoader already uses a DistributedSampler; slipstream shards data itself: "
            "build the DataLoader with shuffle=True/False (or your own sampler) instead"
        )
    sharded = ShardedBatchSampler(
        _seeded_batch_sampler(batch_sampler, state, data_seed),
        num_processes=processes,
        process_index=index,
        split_batches=split_batches,
        even_batches=even_batches,
    )
    if sampler_yields_batches:
        return loader_class(
            dataset, shard=sharded, sampler=sharded, batch_size=None, **common, **kwargs
        )
    return loader_class(dataset, shard=sharded, batch_sampler=sharded, **common, **kwargs)


def _check_coordinates(
    state: ProcessState, num_processes: int | None, process_index: int | None
) -> tuple[int, int] | None:
    """Accept the job's own coordinates for this process (global, or data-parallel under a
    parallel layout: ``None``, the job's layout) and, in a job of one process, another
    layout's (Accelerate builds that shard: ``(num_processes, process_index)``); refuse
    others."""

    def matches(size: int, index: int) -> bool:
        return (num_processes is None or num_processes == size) and (
            process_index is None or process_index == index
        )

    if matches(state.num_processes, state.process_index) or matches(
        state.data_parallel_size, state.data_parallel_index
    ):
        return None
    size = num_processes if num_processes is not None else state.num_processes
    index = process_index if process_index is not None else state.process_index
    if state.num_processes == 1 and 0 <= index < size:
        return size, index
    raise ValueError(
        f"prepare_data_loader(num_processes={num_processes}, process_index={process_index}) "
        f"does not describe this process (process {state.process_index} of "
        f"{state.num_processes}): slipstream prepares a loader for the process that calls it, "
        "over the launched job (another layout only in a job of one process). Leave "
        "num_processes and process_index out"
    )


def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: torch.device | str | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Sequence[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedDataLoader:
    """Accelerate's ``prepare_data_loader``: ``dataloader`` rebuilt so this process gets its
    shard of every global batch (see :func:`shard_data_loader`), over the current process
    state (the Accelerator's or ``PartialState``'s).

    The arguments are Accelerate's, in its order. ``num_processes`` and ``process_index``
    may be given, and must then be this process's (its global coordinates or, under a
    parallel layout, its data-parallel ones), except in a job of one process, where they
    build that process's shard of another layout; ``torch_device_mesh`` is accepted, the job's
    own layout decides which processes share samples. Batches are moved to ``device`` only
    with ``put_on_device=True``. ``rng_types`` ``"torch"``/``"cuda"`` set those global RNGs
    to the main process's state at the start of every pass; shuffle generators are always
    kept in step (``"generator"``). ``use_seedable_sampler`` is accepted and changes
    nothing: a shuffle with the script's generator draws from it, one without is seeded
    (``data_seed``, else ``torch.initial_seed()``) and replayed by ``set_epoch``.
    ``dispatch_batches`` applies to iterable datasets (with ``slice_fn_for_dispatch``
    cutting each process's rows); a map-style dataset is always sharded by index. A loader
    already prepared comes back as it is.

    Example::

        state = PartialState()
        loader = prepare_data_loader(
            DataLoader(ds, batch_size=8, shuffle=True),
            state.device, state.num_processes, state.process_index, put_on_device=True,
        )
    """
    del use_seedable_sampler, torch_device_mesh  # see the docstring
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader
    state = current_state()
    layout = _check_coordinates(state, num_processes, process_index)
    placement = put_on_device and device is not None
    return shard_data_loader(
        dataloader,
        state=state,
        split_batches=split_batches,
        even_batches=even_batches,
        device_placement=placement,
        device=torch.device(device) if placement and device is not None else None,
        non_blocking=non_blocking,
        dispatch_batches=dispatch_batches,
        use_stateful_dataloader=use_stateful_dataloader,
        data_seed=data_seed,
        rng_types=rng_types,
        slice_fn=slice_fn_for_dispatch,
        layout=layout,
    )


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
