"""PreparedDataLoader: a DataLoader yielding this process's shard of each global batch.

It is still a ``torch.utils.data.DataLoader`` (same dataset, workers, collate function),
rebuilt around a :class:`~slipstream.data.samplers.ShardedBatchSampler` or an
:class:`~slipstream.data.iterable.IterableDatasetShard`. On top it

* shuffles identically on every rank (a seeded sampler, or a synchronised generator),
* moves batches to the device,
* knows when it yields its last batch and how many samples of the final global batch are
  real (for ``gather_for_metrics``),
* tracks its position (epoch, batches yielded) so training can resume mid-epoch.

Example::

    loader = shard_data_loader(DataLoader(ds, batch_size=16, shuffle=True), state=state)
    for epoch in range(3):
        for batch in loader:   # epochs advance by themselves; set_epoch(e) also works
            ...
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from ..runtime.state import ProcessState, current_state
from ..runtime.tree import send_to_device
from ..runtime.xla import place_batch
from .active_loaders import ActiveLoaders
from .iterable import ShardedIterable
from .samplers import SeedableRandomSampler, ShardedBatchSampler
from .streaming import SelfShardedStream


class PreparedDataLoader(DataLoader[Any]):
    """A sharded, device-placing DataLoader. Build it with :func:`prepare_data_loader`.

    Prepared loaders are instances of Accelerate's names too: :class:`DataLoaderDispatcher`
    when the main process reads the batches and sends each process its slice
    (``dispatch_batches``), :class:`DataLoaderShard` otherwise.
    """

    #: Accelerate's marker: ``prepare()`` hands a prepared object back as it is.
    _is_accelerate_prepared = True
    #: Whether this loader is also a torchdata ``StatefulDataLoader`` (Accelerate's flag).
    use_stateful_dataloader = False

    def __init__(
        self,
        dataset: Any,
        *,
        state: ProcessState | None = None,
        device: torch.device | None = None,
        shard: ShardedBatchSampler | ShardedIterable | None = None,
        active_loaders: ActiveLoaders | None = None,
        non_blocking: bool = False,
        dispatch: Dispatch | None = None,
        rng_types: Sequence[str] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        #: Global RNGs ("torch", "cuda") set to the main process's state at the start of
        #: every pass (Accelerate's ``rng_types``; shuffle generators are always kept in step).
        names = [str(getattr(r, "value", r)).lower() for r in rng_types or ()]
        self.rng_types = [name for name in names if name != "generator"]
        #: With ``dispatch_batches``: how the main process's global batches are shared.
        self.dispatch = dispatch
        #: Real rows of the batch just yielded: this process's (a stream that shards
        #: itself) or the global batch's (dispatched); ``None`` when all are real.
        self.real_rows: int | None = None
        self._dispatched_real: int | None = None
        self.state = state if state is not None else current_state()
        self.device = torch.device(device) if device is not None else None
        self.shard = shard
        self.active_loaders = active_loaders if active_loaders is not None else ActiveLoaders()
        self.non_blocking = non_blocking
        #: True while the batch just yielded is the last one of this pass.
        self.end_of_dataloader = False
        #: Batches yielded so far in the current pass (including skipped ones on resume).
        self.batches_yielded = 0
        self._epoch = 0
        self._iterable_skip = 0
        #: Shuffle generators' states at the start of the current pass (for exact resume).
        self._pass_generator_states: list[torch.Tensor | None] = []
        #: True from the start of a pass until it completes (or is started again).
        self._in_pass = False
        self._generators_to_restore: list[torch.Tensor | None] | None = None
        #: Batches of the next pass already consumed before a checkpoint that the batch
        #: source itself resumes after (a stateful dataset), so nothing is re-read.
        self._resumed_batches = 0

    @property
    def gradient_state(self) -> Any:
        """The ``GradientState`` of the Accelerator that prepared this loader (``None``
        for one prepared without an Accelerator)."""
        source = self.active_loaders.gradient_state
        return source() if source is not None else None

    # -- epochs and shuffling -----------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def iteration(self) -> int:
        """Accelerate's name for :attr:`epoch`."""
        return self._epoch

    @iteration.setter
    def iteration(self, epoch: int) -> None:
        self._epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass's shuffle (passes also advance it by themselves);
        samplers (and batch samplers) with a ``set_epoch`` of their own hear it now."""
        self._epoch = epoch
        for obj in self._epoch_aware():
            obj.set_epoch(epoch)

    def _epoch_aware(self) -> list[Any]:
        objects: list[Any] = []
        if isinstance(self.shard, ShardedIterable):
            objects.append(self.shard)
        elif self.shard is not None:
            objects += [self.shard.batch_sampler, self.shard.sampler]
        else:
            objects += [self.batch_sampler, getattr(self.batch_sampler, "sampler", None)]
        return [o for o in objects if o is not None and callable(getattr(o, "set_epoch", None))]

    def _generators(self) -> list[torch.Generator | None]:
        """The shuffle generators of the samplers underneath, in a fixed order."""
        owners = [getattr(self.shard, "sampler", None), getattr(self.shard, "batch_sampler", None)]
        found = [getattr(owner, "generator", None) for owner in owners]
        return [g if isinstance(g, torch.Generator) else None for g in found]

    def _start_pass(self) -> None:
        for obj in self._epoch_aware():
            obj.set_epoch(self._epoch)
        if self.rng_types and self.state.num_processes > 1:
            from ..runtime.synchronize import synchronize_rng_states

            synchronize_rng_states(self.rng_types)
        generators = self._generators()
        if self._generators_to_restore is not None:
            for generator, saved in zip(generators, self._generators_to_restore, strict=False):
                if generator is not None and saved is not None:
                    generator.set_state(saved)
            self._generators_to_restore = None
        if self.state.num_processes > 1:
            self._synchronise_generators(generators)
        self._pass_generator_states = [g.get_state() if g is not None else None for g in generators]

    def _synchronise_generators(self, generators: list[torch.Generator | None]) -> None:
        # A custom sampler that draws from its own torch.Generator shuffles identically on
        # every rank once the generators agree; rank 0's state is the reference.
        from ..runtime.collectives import broadcast

        for generator in generators:
            if generator is not None:
                rng_state = generator.get_state().to(self.state.device)
                broadcast(rng_state, from_process=0, state=self.state)
                generator.set_state(rng_state.cpu())

    # -- tail information -----------------------------------------------------------------
    @property
    def final_real_samples(self) -> int | None:
        """Real samples in the final global batch, once the last batch has been yielded.

        ``None`` when the final global batch is complete (nothing to drop) or unknown.
        """
        if not self.end_of_dataloader:
            return None
        if self.dispatch is not None:
            return self._dispatched_real
        return self.shard.final_real_samples if self.shard is not None else None

    @property
    def uneven_tail(self) -> bool:
        """True when the final batch sizes may differ across ranks (``even_batches=False``)."""
        if isinstance(self.shard, ShardedBatchSampler):
            return self.shard.uneven_tail
        if self.dispatch is not None:
            return not self.dispatch.even_batches and self._dispatched_real is not None
        if isinstance(self.shard, ShardedIterable):
            return not self.shard.even_batches and self.shard.final_real_samples is not None
        return False

    @property
    def batches_left(self) -> int | None:
        """Batches of this pass not yet yielded, counting the current one (None if unknown)."""
        try:
            length = len(self)
        except TypeError:
            return None
        return max(0, length - self.batches_yielded + 1)

    @property
    def total_batch_size(self) -> int | None:
        """Samples per optimizer step over all processes."""
        if self.dispatch is not None:
            return self.dispatch.per_process * self.state.data_parallel_size
        if isinstance(self.shard, ShardedIterable):
            return self.shard.global_batch_size
        size = getattr(self.shard, "batch_size", None) or self.batch_size
        if size is None:
            return None
        split = getattr(self.shard, "split_batches", False)
        return size if split else size * self.state.data_parallel_size

    # -- iteration ----------------------------------------------------------------------
    def skip_next_pass(self, num_batches: int) -> None:
        """Leave out the first ``num_batches`` batches of the next pass only."""
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        if isinstance(self.shard, ShardedBatchSampler):
            self.shard.skip_batches = num_batches
        else:
            self._iterable_skip = num_batches

    def _pass_length(self) -> int | None:
        """Batches in a whole pass when known exactly (torch's BatchSampler underneath)."""
        if (
            isinstance(self.shard, ShardedBatchSampler)
            and type(self.shard.batch_sampler) is BatchSampler
        ):
            return self.shard.epoch_length()
        return None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._start_pass()
        self._in_pass = True
        pending_skip = self.shard.skip_batches if isinstance(self.shard, ShardedBatchSampler) else 0
        iterable_skip, self._iterable_skip = self._iterable_skip, 0
        resumed, self._resumed_batches = self._resumed_batches, 0
        # Starting an iterator draws a worker seed from torch's RNG. When resuming mid-epoch
        # that draw already happened before the checkpoint, so undo it to stay bitwise exact.
        mid_epoch = pending_skip or iterable_skip or resumed
        resumed_rng = torch.get_rng_state() if mid_epoch else None
        batches: Iterator[Any] = self._batches()
        if resumed_rng is not None:
            torch.set_rng_state(resumed_rng)
        length = self._pass_length()
        self.batches_yielded = pending_skip + resumed
        self.end_of_dataloader = False
        # The loader may be handed to another Accelerator while it runs (prepare() adopts
        # prepared loaders): this pass ends on the stack it started on.
        active = self.active_loaders
        active.push(self)
        try:
            for _ in range(iterable_skip):
                if next(batches, _EXHAUSTED) is _EXHAUSTED:
                    break
                if self._notes:
                    self._notes.popleft()
                self.batches_yielded += 1
            before_batch = active.before_batch
            if before_batch is not None:
                batches = _checked(batches, before_batch)
            # Per-batch position updates write the instance dict directly: DataLoader's own
            # __setattr__ is Python code and would run twice for every batch.
            position = self.__dict__
            if length is not None:
                # The position says which batch is last: no look-ahead, so batches are
                # loaded exactly when plain PyTorch would load them.
                for batch in batches:
                    yielded = position["batches_yielded"] + 1
                    position["batches_yielded"] = yielded
                    position["end_of_dataloader"] = yielded >= length
                    yield self._place(batch)
            else:
                notes = self._notes
                capture = self._capture_position
                current = next(batches, _EXHAUSTED)
                while current is not _EXHAUSTED:
                    note = notes.popleft() if notes else None  # before the look-ahead's
                    if capture is not None:
                        capture()  # the source's state after `current`, before the look-ahead
                    upcoming = next(batches, _EXHAUSTED)
                    position["end_of_dataloader"] = upcoming is _EXHAUSTED
                    position["batches_yielded"] += 1
                    if note is not None:
                        self._take_note(note)
                    yield self._place(current)
                    current = upcoming
            self._epoch += 1
            self._in_pass = False
            self.batches_yielded = 0
        finally:
            active.pop(self)
        if active.on_pass_end is not None:
            active.on_pass_end(self)

    # -- streams that shard themselves, and dispatched batches -------------------------------
    @property
    def _notes(self) -> collections.deque[tuple[str, int | None]]:
        """Per-batch facts the batch source records, in the order of its batches."""
        return self.__dict__.setdefault("_batch_notes", collections.deque())

    def _take_note(self, note: tuple[str, int | None]) -> None:
        kind, real = note
        if kind == "rows":
            self.real_rows = real
        else:
            self._dispatched_real = real

    def _batches(self) -> Iterator[Any]:
        """The underlying batches: read here, or received from the main process."""
        self._notes.clear()
        self.real_rows = self._dispatched_real = None
        if self.dispatch is None:
            batches = super().__iter__()
            if isinstance(self.shard, SelfShardedStream):
                return _noted(batches, self.shard.real_rows, self._notes)
            return batches
        from .dispatch import dispatched_batches

        view = self.state.data_parallel
        source = super().__iter__() if view.process_index == 0 else None  # only it reads
        return self._note_dispatched(
            dispatched_batches(
                source,
                view,
                per_process=self.dispatch.per_process,
                even_batches=self.dispatch.even_batches,
                drop_last=self.dispatch.drop_last,
                slice_fn=self.dispatch.slice_fn,
            )
        )

    def _note_dispatched(self, batches: Iterator[tuple[Any, int | None]]) -> Iterator[Any]:
        for batch, real in batches:
            self._notes.append(("global", real))
            yield batch

    def _place(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        if self.device.type == "xla":  # the step barrier, then an asynchronous transfer
            return place_batch(batch, self.device)
        return send_to_device(batch, self.device, self.non_blocking)

    def __len__(self) -> int:
        length = super().__len__()
        if not isinstance(self.shard, ShardedBatchSampler):
            length = max(0, length - self._iterable_skip)
        return length

    # -- position for checkpoints -------------------------------------------------------
    #: Called at each batch boundary of a stream to record the batch source's own state
    #: (set by loaders whose dataset resumes from its state; see ``stateful.py``).
    _capture_position: Callable[[], None] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batches yielded in it and the shuffle state: enough to resume exactly."""
        return self.position_state()

    def process_state(self) -> Any:
        """This process's own part of the loader's state (``None``: the position says all);
        checkpoints keep it per process."""
        return None

    def position_state(self) -> dict[str, Any]:
        """The position, the same on every process (JSON: it goes in checkpoint manifests)."""
        sampler = getattr(self.shard, "sampler", None)
        return {
            "epoch": self._epoch,
            "batches_yielded": self.batches_yielded,
            "sampler": sampler.state_dict() if isinstance(sampler, SeedableRandomSampler) else None,
            "generators": [
                state.tolist() if state is not None else None
                for state in self._resume_generator_states()
            ],
            # Older checkpoints saved the generators only for a mid-pass resume.
            "generators_for_next_pass": True,
            "num_processes": self.state.data_parallel_size,
            "split_batches": bool(getattr(self.shard, "split_batches", False)),
        }

    def _resume_generator_states(self) -> list[torch.Tensor | None]:
        """The shuffle generators' states the next pass after a resume must start from:
        inside a pass (even before its first batch, where a preempted job saves), this
        pass's starting states (its order is drawn again, then skipped into); between
        passes, their states now (the next pass draws from them)."""
        if self._in_pass or self.batches_yielded:
            return self._pass_generator_states
        return [g.get_state() if g is not None else None for g in self._generators()]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the position saved by :meth:`state_dict` on the next pass."""
        self._epoch = int(state["epoch"])
        sampler = getattr(self.shard, "sampler", None)
        if state.get("sampler") and isinstance(sampler, SeedableRandomSampler):
            sampler.load_state_dict(state["sampler"])
        if state.get("generators") and (
            state["batches_yielded"] or state.get("generators_for_next_pass")
        ):
            # The next pass draws its order from the generators' saved states, as the
            # interrupted run did (or would have, at an epoch boundary).
            self._generators_to_restore = [
                torch.tensor(saved, dtype=torch.uint8) if saved is not None else None
                for saved in state["generators"]
            ]
        own = state.get("process_state")
        if own is not None and self._restore_process_state(own):
            self._resumed_batches = int(state["batches_yielded"])  # nothing to re-read
            return
        self.skip_next_pass(self.resume_position(state))

    def _restore_process_state(self, state: Any) -> bool:
        """Resume the batch source from ``state`` (see :meth:`process_state`); False when
        this loader cannot, and skips to its position instead."""
        return False

    def resume_position(self, state: dict[str, Any]) -> int:
        """Batches to skip, translated when the checkpoint came from another number of
        data-parallel processes."""
        done = int(state["batches_yielded"])
        saved_world = int(state.get("num_processes", self.state.data_parallel_size))
        world = self.state.data_parallel_size
        if done == 0 or saved_world == world or state.get("split_batches"):
            return done
        samples = done * saved_world
        if samples % world:
            raise ValueError(
                f"this dataloader stopped mid-epoch after {done} batches on each of {saved_world} "
                f"data-parallel processes; that position has no equivalent on {world}. Resume "
                f"with {saved_world} data-parallel processes, or from a checkpoint saved at an "
                "epoch boundary"
            )
        return samples // world


_EXHAUSTED = object()


@dataclass(frozen=True)
class Dispatch:
    """How the main process's global batches are shared (``dispatch_batches``)."""

    per_process: int
    even_batches: bool = True
    drop_last: bool = False
    #: Accelerate's ``slice_fn_for_dispatch``: ``slice_fn(batch, slice, process_index=,
    #: num_processes=)`` cuts each process's rows (default: every tensor along dim 0).
    slice_fn: Callable[..., Any] | None = None


def _noted(
    batches: Iterator[Any],
    real_rows: collections.deque[int | None],
    notes: collections.deque[tuple[str, int | None]],
) -> Iterator[Any]:
    """Pass on each batch of a self-sharding stream with a note of its real rows."""
    for batch in batches:
        notes.append(("rows", real_rows.popleft() if real_rows else None))
        yield batch


def _checked(batches: Iterator[Any], before: Callable[[], None]) -> Iterator[Any]:
    """``batches``, calling ``before()`` before fetching each one (so a checkpoint taken
    there records the position, and random state, of a step boundary)."""
    while True:
        before()
        batch = next(batches, _EXHAUSTED)
        if batch is _EXHAUSTED:
            return
        yield batch
