"""Pure samplers: every sharding decision is a function of explicit ``(rank, world)``.

Nothing here talks to other processes, so each rank's view can be computed (and tested) in
one process.

* :class:`SeedableRandomSampler` — a shuffle that depends only on ``(seed, epoch)``, so all
  ranks shuffle identically without communicating (Accelerate's constructor works too).
* :class:`ShardedBatchSampler` — hands each rank its part of every *global* batch: whole
  batches in turn (bucketing samplers keep their meaning) or, with ``split_batches``, a
  slice of each batch.
* :class:`SkipBatchSampler` — drops the first ``n`` batches of another batch sampler.

Tail handling, used by ``gather_for_metrics``: in the last, incomplete global batch the real
indices come first and the duplicates used to complete it (``even_batches``) come last, in
rank order; :attr:`ShardedBatchSampler.final_real_samples` says how many are real.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler


class SeedableRandomSampler(RandomSampler):
    """A random order of the samples that depends only on ``seed + epoch``.

    Two ways to build it:

    * slipstream's: ``SeedableRandomSampler(length, seed, *, replacement, num_samples)``;
    * Accelerate's: ``SeedableRandomSampler(data_source, replacement=False, num_samples=None,
      generator=None, data_seed=None)``, the seed being ``data_seed`` or, without one,
      ``torch.initial_seed()`` (so ``set_seed`` decides it).

    Each pass draws from a generator seeded with ``seed + epoch`` (``generator`` when one is
    given, re-seeded each pass as Accelerate does), and a complete pass moves on to the next
    epoch, so a plain ``DataLoader`` reshuffles every epoch; ``set_epoch(e)`` replays epoch
    ``e``. It is a ``RandomSampler`` and draws as one does, so epoch ``e``'s order is
    ``RandomSampler``'s with a generator seeded ``seed + e``.

    Example::

        sampler = SeedableRandomSampler(100, seed=1234)
        sampler.set_epoch(3)
        order = list(sampler)   # identical on every process

        sampler = SeedableRandomSampler(dataset, data_seed=1234)  # Accelerate's form
    """

    def __init__(
        self,
        data_source: Sized | int | None = None,
        *args: Any,
        length: int | None = None,
        seed: int | None = None,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        if length is not None or (
            isinstance(data_source, int) and not isinstance(data_source, bool)
        ):
            # slipstream's form: (length, seed, *, replacement, num_samples)
            if length is not None and data_source is not None:
                raise TypeError("pass the dataset (data_source) or its length, not both")
            if len(args) > 1:
                raise TypeError(
                    "SeedableRandomSampler(length, seed, *, replacement, num_samples) takes "
                    f"two positional arguments; got {1 + len(args)}"
                )
            if args:
                if seed is not None:
                    raise TypeError("seed given twice (positionally and by keyword)")
                seed = args[0]
            size = length if length is not None else data_source
            assert isinstance(size, int)
            if size < 0:
                raise ValueError(f"length must be >= 0, got {size}")
            data_source = range(size)
        else:
            # Accelerate's form: RandomSampler's arguments, then data_seed.
            names = ("replacement", "num_samples", "generator", "data_seed")
            if len(args) > len(names):
                raise TypeError(
                    "SeedableRandomSampler(data_source, replacement, num_samples, generator, "
                    f"data_seed) takes at most 5 positional arguments; got {1 + len(args)}"
                )
            given = dict(zip(names, args, strict=False))
            replacement = given.get("replacement", replacement)
            num_samples = given.get("num_samples", num_samples)
            generator = given.get("generator", generator)
            data_seed = given.get("data_seed", data_seed)
            if data_source is None or not isinstance(data_source, Sized):
                raise TypeError(
                    "SeedableRandomSampler takes a dataset (anything with a length) or "
                    f"length=N; got {type(data_source).__name__}"
                )
        if seed is not None and data_seed is not None and int(seed) != int(data_seed):
            raise TypeError(f"seed={seed} and data_seed={data_seed} disagree: pass one")
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, got {replacement!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(f"num_samples should be an integer >= 0, got {num_samples!r}")
        # RandomSampler.__init__ is not called: it refuses empty datasets, which a sharded
        # evaluation set can be; these are the attributes it sets.
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        chosen = seed if seed is not None else data_seed
        self.seed = int(chosen) if chosen is not None else torch.initial_seed()
        self.epoch = 0

    @property
    def length(self) -> int:
        """How many samples the order is drawn from."""
        return len(self.data_source)

    @property
    def initial_seed(self) -> int:
        """Accelerate's name for :attr:`seed`."""
        return self.seed

    @initial_seed.setter
    def initial_seed(self, value: int) -> None:
        self.seed = int(value)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        if n:
            # A generator of our own unless one was given: a sampler that owns no generator
            # is one slipstream never needs to synchronise or checkpoint.
            generator = self.generator if self.generator is not None else torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            yield from _random_order(n, self.num_samples, self.replacement, generator)
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])


def _random_order(
    n: int, num_samples: int, replacement: bool, generator: torch.Generator
) -> Iterator[int]:
    """``RandomSampler``'s draws from ``generator`` (the same calls, so the same order)."""
    if replacement:
        for _ in range(num_samples // 32):
            yield from torch.randint(n, (32,), dtype=torch.int64, generator=generator).tolist()
        yield from torch.randint(
            n, (num_samples % 32,), dtype=torch.int64, generator=generator
        ).tolist()
        return
    for _ in range(num_samples // n):
        yield from torch.randperm(n, generator=generator).tolist()
    yield from torch.randperm(n, generator=generator).tolist()[: num_samples % n]


def _chunks(indices: list[Any], parts: int) -> list[list[Any]]:
    """Split into ``parts`` consecutive chunks, the first ``len % parts`` one longer."""
    size, extra = divmod(len(indices), parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        out.append(indices[start:stop])
        start = stop
    return out


def check_shard_arguments(
    num_processes: int, process_index: int, split_batches: bool, batch_size: int | None
) -> None:
    """Reject a rank outside the world, or a batch that cannot be split evenly."""
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"process_index={process_index} is not valid for num_processes={num_processes}"
        )
    if split_batches and batch_size is not None and batch_size % num_processes:
        raise ValueError(
            f"split_batches=True needs a batch size divisible by the number of processes; "
            f"got batch_size={batch_size} with {num_processes} processes: use a multiple of "
            f"{num_processes}"
        )


def _flag_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` using one item of look-ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for upcoming in iterator:
        yield current, False
        current = upcoming
    yield current, True


def _complete(real: list[Any], target: int, initial: list[Any]) -> list[Any]:
    """Extend ``real`` to ``target`` items by cycling through ``initial`` (the epoch's start)."""
    if len(real) >= target or not initial:
        return list(real)
    need = target - len(real)
    return list(real) + list(itertools.islice(itertools.cycle(initial), need))


class ShardedBatchSampler(Sampler[list[Any]]):
    """This rank's batches out of a batch sampler shared by ``num_processes`` ranks.

    Without ``split_batches`` a global batch is ``num_processes`` consecutive batches and
    rank ``r`` takes the ``r``-th one; with ``split_batches`` each batch is a global batch and
    rank ``r`` takes the ``r``-th slice. With ``even_batches`` (default) a short final
    global batch is completed with indices from the start of the epoch so every rank takes
    the same number of full steps; without it ranks may take different numbers of steps.
    ``drop_last`` on the wrapped sampler drops an incomplete final global batch.

    Example::

        inner = BatchSampler(range(10), batch_size=2, drop_last=False)
        list(ShardedBatchSampler(inner, num_processes=2, process_index=1))
        # [[2, 3], [6, 7], [0, 1]]  (the last batch completed from the start)
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[Any]],
        *,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        check_shard_arguments(num_processes, process_index, split_batches, None)
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        check_shard_arguments(num_processes, process_index, split_batches, self.batch_size)
        #: Global indices in the final global batch that are real (not completion); set
        #: once iteration reaches it. ``None`` until then.
        self.final_real_samples: int | None = None
        #: Whether this rank's batch sizes may differ across ranks at the end.
        self.uneven_tail = False
        #: Batches to leave out at the start of the next iteration only (resuming).
        self.skip_batches = 0

    # -- iteration ----------------------------------------------------------------------
    @property
    def sampler(self) -> Any:
        """The index sampler underneath (for ``set_epoch`` and state), if there is one."""
        return getattr(self.batch_sampler, "sampler", None)

    def _global_batches(self) -> Iterator[tuple[list[list[Any]], int | None]]:
        """Yield (per-rank parts, real count when this is an incomplete final batch)."""
        parts = self.num_processes
        if parts == 1:
            # One process: nothing is completed, but a short final batch is still the
            # final global batch of fewer real samples (gather_for_metrics cuts to it).
            for batch, is_last in _flag_last(self.batch_sampler):
                short = is_last and self.batch_size is not None and len(batch) < self.batch_size
                yield [list(batch)], len(batch) if short else None
            return
        if self.split_batches:
            yield from self._split_global_batches()
        else:
            yield from self._grouped_global_batches()

    def _split_global_batches(self) -> Iterator[tuple[list[list[Any]], int | None]]:
        parts = self.num_processes
        initial: list[Any] = []
        target = self.batch_size
        for batch, is_last in _flag_last(self.batch_sampler):
            batch = list(batch)
            if target is None:
                # A batch sampler without batch_size: its first batch sets the size.
                target = len(batch)
                check_shard_arguments(parts, self.process_index, True, target)
            if len(initial) < target:
                initial.extend(batch)
            if len(batch) >= target:
                yield _chunks(batch, parts), None
            elif is_last:
                completed = _complete(batch, target, initial) if self.even_batches else batch
                yield _chunks(completed, parts), len(batch)
            elif len(batch) < parts and self.even_batches:
                # A short batch inside the epoch must still give every rank a sample.
                yield _chunks(_complete(batch, parts, initial), parts), None
            else:
                yield _chunks(batch, parts), None

    def _grouped_global_batches(self) -> Iterator[tuple[list[list[Any]], int | None]]:
        parts = self.num_processes
        initial: list[Any] = []
        group: list[list[Any]] = []
        batch_size = self.batch_size
        for batch, is_last in _flag_last(self.batch_sampler):
            batch = list(batch)
            batch_size = batch_size or len(batch)
            if len(initial) < batch_size * parts:
                initial.extend(batch)
            group.append(batch)
            if len(group) == parts:
                if is_last and len(batch) < batch_size:
                    break  # a short batch ends the epoch: complete it as the tail below
                yield group, None
                group = []
        if not group or self.drop_last:
            return
        real = [index for batch in group for index in batch]
        if self.even_batches:
            completed = _complete(real, (batch_size or 1) * parts, initial)
            yield _chunks(completed, parts), len(real)
        else:
            # Each rank takes its own batch if there is one; no duplicates.
            yield [group[r] if r < len(group) else [] for r in range(parts)], len(real)

    def _order_can_be_listed(self) -> bool:
        """Whether the wrapped sampler is torch's BatchSampler over a sequential or random
        sampler: its batches are then consecutive slices of one index order, drawn up front
        (as those samplers draw their whole permutation when iteration starts anyway)."""
        inner = self.batch_sampler
        return (
            type(inner) is BatchSampler
            and type(inner.sampler) in (SequentialSampler, RandomSampler, SeedableRandomSampler)
            and not self.split_batches
            and self.num_processes > 1
        )

    def __iter__(self) -> Iterator[list[Any]]:
        # Everything happens on the first next(), the skip taken included: a loader may
        # make an iterator and drop it unused (torchdata's worker iterator makes one when it
        # is built and another when it resets), and the pass to resume is the one that runs.
        self.final_real_samples = None
        self.uneven_tail = False
        to_skip, self.skip_batches = self.skip_batches, 0
        # Either way the index order is drawn on the first next(), as plain torch does.
        if self._order_can_be_listed():
            yield from self._batches_from_order(to_skip)
        else:
            yield from self._batches_from_groups(to_skip)

    def _batches_from_order(self, to_skip: int) -> Iterator[list[Any]]:
        """This rank's batches sliced straight out of the pass's index order: the batches
        :meth:`_batches_from_groups` gives, at one generator step per batch (this runs for
        every training step)."""
        sampler = self.batch_sampler.sampler  # type: ignore[attr-defined]
        order: Sequence[Any] = (
            range(len(sampler)) if type(sampler) is SequentialSampler else list(sampler)
        )
        size, parts, rank = int(self.batch_size or 1), self.num_processes, self.process_index
        global_size = size * parts
        full = len(order) // global_size
        for start in range(global_size * to_skip + size * rank, global_size * full, global_size):
            yield list(order[start : start + size])
        tail = order[global_size * full :]
        if not tail or self.drop_last:
            return
        if self.even_batches:
            completed = _complete(list(tail), global_size, list(order[:global_size]))
            mine = _chunks(completed, parts)[rank]
        else:
            mine = list(tail[size * rank : size * (rank + 1)])
        self.final_real_samples = len(tail)
        self.uneven_tail = not self.even_batches
        if mine and to_skip <= full:
            yield mine

    def _batches_from_groups(self, to_skip: int) -> Iterator[list[Any]]:
        """This rank's batches, taking the wrapped batch sampler's batches one by one."""
        for parts, real in self._global_batches():
            if real is not None:
                self.final_real_samples = real
                self.uneven_tail = not self.even_batches
            mine = parts[self.process_index]
            if not mine:
                continue
            if to_skip:
                to_skip -= 1
                continue
            yield mine

    def __len__(self) -> int:
        if not isinstance(self.batch_sampler, Sized):
            raise TypeError("the wrapped batch sampler has no length")
        return max(0, self.epoch_length() - self.skip_batches)

    def epoch_length(self) -> int:
        """Batches this rank takes in a whole pass (ignoring a pending skip)."""
        batches = len(self.batch_sampler)  # type: ignore[arg-type]
        parts, rank = self.num_processes, self.process_index
        if self.split_batches:
            if self.even_batches or self.drop_last:
                return batches
            last = self._last_batch_size()
            # A short final batch split across ranks leaves later ranks empty-handed.
            return batches - (1 if last is not None and last < parts and rank >= last else 0)
        if self.drop_last:
            return batches // parts
        if self.even_batches:
            return math.ceil(batches / parts)
        return batches // parts + (1 if rank < batches % parts else 0)

    def _last_batch_size(self) -> int | None:
        sampler = self.sampler
        if self.batch_size is None or not isinstance(sampler, Sized):
            return None
        remainder = len(sampler) % self.batch_size
        return remainder or None


class SkipBatchSampler(Sampler[list[Any]]):
    """Yield the batches of ``batch_sampler`` after the first ``skip``.

    Example::

        SkipBatchSampler(BatchSampler(range(10), 2, False), skip=3)  # [[6, 7], [8, 9]]
    """

    def __init__(self, batch_sampler: Iterable[list[Any]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[Any]]:
        yield from itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        if not isinstance(self.batch_sampler, Sized):
            raise TypeError("the wrapped batch sampler has no length")
        return max(0, len(self.batch_sampler) - self.skip)
