"""Accelerate's loader classes built directly with Accelerate's constructor, and what a
prepared loader offers Accelerate's code: ``gradient_state``, ``iteration``, ``set_epoch``
reaching a custom batch sampler at once."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from slipstream import Accelerator
from slipstream.data import DataLoaderDispatcher, DataLoaderShard, skip_first_batches


class EpochBatchSampler(BatchSampler):
    """A custom batch sampler with a set_epoch of its own."""

    def __init__(self, n: int) -> None:
        super().__init__(SequentialSampler(range(n)), batch_size=4, drop_last=False)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.mark.parametrize("cls", [DataLoaderShard, DataLoaderDispatcher])
def test_built_directly_with_accelerates_arguments(cls):
    loader = cls(list(range(10)), batch_size=4, device="cpu", skip_batches=1)
    assert [b.tolist() for b in loader] == [[4, 5, 6, 7], [8, 9]]  # the skip: first pass only
    ends = [loader.end_of_dataloader for _ in loader]
    assert ends == [False, False, True] and not loader.use_stateful_dataloader
    loader.set_epoch(3)
    assert loader.iteration == 3 and skip_first_batches(loader, 1).iteration == 3


@pytest.mark.parametrize("cls", [DataLoaderShard, DataLoaderDispatcher])
def test_built_directly_as_a_stateful_loader_resumes_exactly(cls):
    from torchdata.stateful_dataloader import StatefulDataLoader

    first = cls(list(range(16)), batch_size=4, use_stateful_dataloader=True, num_workers=2)
    assert isinstance(first, StatefulDataLoader) and isinstance(first, cls)
    assert first.use_stateful_dataloader
    seen = []
    for index, batch in enumerate(first):
        seen.append(batch.tolist())
        if index == 1:
            saved = first.state_dict()
    second = cls(list(range(16)), batch_size=4, use_stateful_dataloader=True, num_workers=2)
    second.load_state_dict(saved)
    assert [b.tolist() for b in second] == seen[2:]


def test_set_epoch_reaches_a_custom_batch_sampler_at_once():
    sampler = EpochBatchSampler(16)
    loader = Accelerator().prepare_data_loader(DataLoader(list(range(16)), batch_sampler=sampler))
    loader.set_epoch(2)
    assert sampler.epoch == 2


def test_a_prepared_loader_has_its_accelerators_gradient_state_and_holds_it_weakly():
    accelerator = Accelerator()
    loader = accelerator.prepare_data_loader(DataLoader(list(range(8)), batch_size=4))
    batches = iter(loader)
    next(batches)
    assert loader.gradient_state.active_dataloader is loader
    assert loader.gradient_state.end_of_dataloader is False
    pickle.loads(pickle.dumps(accelerator))  # the weakly held hooks pickle as methods
    gc.collect()
    gc.disable()  # dropped by reference counting alone: no cycle keeps it (or its models)
    try:
        owner, held = weakref.ref(accelerator), weakref.ref(loader)
        del accelerator, loader, batches
        assert owner() is None and held() is None
    finally:
        gc.enable()


def test_a_dispatcher_built_directly_in_a_job_of_several_processes_is_refused(monkeypatch):
    from slipstream.runtime.state import ProcessState

    monkeypatch.setattr(ProcessState, "data_parallel_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="prepare it with dispatch_batches=True"):
        DataLoaderDispatcher(list(range(8)), batch_size=4)
