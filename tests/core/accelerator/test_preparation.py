"""prepare() on objects prepared before, and pickling an Accelerator that holds prepared
objects: on 2 real processes (DDP-wrapped models, sharded loaders)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, PrepareError
from slipstream.data import DataLoaderShard
from tests.distributed import run_distributed


def _parts(samples: int = 10):
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.arange(samples)), batch_size=4)
    return model, optimizer, scheduler, loader


def _prepared_again() -> dict:
    acc = Accelerator()
    prepared = acc.prepare(*_parts())
    again = acc.prepare(*prepared)
    model, optimizer, scheduler, loader = prepared
    one_by_one = [
        acc.prepare_model(model),
        acc.prepare_optimizer(optimizer),
        acc.prepare_scheduler(scheduler),
        acc.prepare_data_loader(loader),
    ]
    registered = [len(acc._models), len(acc._optimizers), len(acc._schedulers)]
    registered.append(len(acc._dataloaders))
    # Another Accelerator adopts the loader and the model; its gather_for_metrics then drops
    # the samples repeated to even out the last batch (10 samples, global batches of 8).
    other = Accelerator()
    adopted = other.prepare(loader, model)
    seen = [i for (batch,) in loader for i in other.gather_for_metrics(batch).tolist()]
    errors = []
    for thing in (optimizer, scheduler):
        try:
            other.prepare(thing)
        except PrepareError as error:
            errors.append(str(error))
    return {
        "same": all(a is b for a, b in zip(again, prepared, strict=True)),
        "one_by_one": all(a is b for a, b in zip(one_by_one, prepared, strict=True)),
        "wrapped": isinstance(model, nn.parallel.DistributedDataParallel),
        "marked": [getattr(obj, "_is_accelerate_prepared", False) for obj in prepared],
        "registered": registered,
        "adopted": adopted[0] is loader and adopted[1] is model,
        "other_registered": [other._dataloaders == [loader], other._models == [model]],
        "seen": seen,
        "errors": errors,
    }


def test_preparing_prepared_objects_hands_them_back():
    for result in run_distributed(_prepared_again):
        assert result["same"] and result["one_by_one"]
        assert result["wrapped"] is True
        assert result["marked"] == [True, True, True, True]
        assert result["registered"] == [1, 1, 1, 1], "each registered once"
        assert result["adopted"] and result["other_registered"] == [True, True]
        assert result["seen"] == list(range(10)), "the adopting Accelerator sees the loader"
        assert len(result["errors"]) == 2
        assert "optimizer prepared by another Accelerator" in result["errors"][0]
        assert "scheduler prepared by another Accelerator" in result["errors"][1]


def test_a_model_prepared_on_one_process_is_not_prepared_twice():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(nn.Linear(2, 2))  # the same module, its forward under autocast
    forward = model.forward
    assert acc.prepare(model) is model and model.forward is forward
    assert Accelerator().prepare(model) is model, "another Accelerator adopts it too"
    with pytest.raises(PrepareError, match="same Linear twice"):
        acc.prepare(model, model)


class PassCounter:
    """A callback that records which Accelerator saw each finished pass."""

    def __init__(self) -> None:
        self.passes: list[int] = []

    def on_dataloader_epoch_end(self, accelerator, dataloader) -> None:
        self.passes.append(id(accelerator))


def _pickled() -> dict:
    counter = PassCounter()
    acc = Accelerator(callbacks=[counter])
    model, optimizer, _, loader = _parts(samples=12)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    loader = acc.prepare(loader)  # as Accelerate's test_pickle_accelerator does
    copy = pickle.loads(pickle.dumps(acc))
    copied_loader = copy._dataloaders[0]
    (copied_counter,) = copy.callbacks.callbacks
    return {
        "state": acc.state.__dict__ == copy.state.__dict__,
        "batches": [b.tolist() for (b,) in loader] == [b.tolist() for (b,) in copied_loader],
        "class": isinstance(copied_loader, DataLoaderShard),
        "callback_owner": copied_counter.passes == [id(copy)] and counter.passes == [id(acc)],
        "gathered": copy.gather_for_metrics(next(iter(copied_loader))[0]).tolist(),
    }


def test_an_accelerator_with_prepared_objects_pickles():
    for result in run_distributed(_pickled):
        assert result["state"] and result["batches"] and result["class"]
        assert result["callback_owner"], "the copy's passes reach the copy's callbacks"
        assert result["gathered"] == list(range(8))


def _evaluation_mode() -> dict:
    acc = Accelerator(dynamo_backend="eager")
    original = nn.Linear(3, 1)
    model = acc.prepare_model(original, evaluation_mode=True)
    seen = {
        "evaluation": type(model._orig_mod).__name__,
        "kept_compiled": acc.unwrap_model(model, keep_torch_compile=True) is model,
        "plain": acc.unwrap_model(model) is original,
        "registered": any(m is model for m in acc._models),
    }
    # Training prepares it again: now it is wrapped for data parallelism.
    trained = acc.prepare(original)
    seen["training"] = isinstance(trained._orig_mod, nn.parallel.DistributedDataParallel)
    # A compiled DDP wrapper is not rewired: a new compiled wrapper of the user's module.
    kept = acc.unwrap_model(trained, keep_torch_compile=True)
    seen["compiled_ddp_unwraps_plain"] = kept is not trained and kept._orig_mod is original
    return seen


def test_a_model_prepared_for_evaluation_gets_no_ddp_wrapper_until_training():
    for seen in run_distributed(_evaluation_mode):
        assert seen == {
            "evaluation": "Linear",
            "kept_compiled": True,
            "plain": True,
            "registered": True,
            "training": True,
            "compiled_ddp_unwraps_plain": True,
        }


def test_gather_for_metrics_on_one_process_cuts_the_final_batch_to_its_samples():
    # Trainer's evaluation repeats each batch's mean loss `batch_size` times; Accelerate cuts
    # the final, short batch to its real samples (gradient_state.remainder) on one process too.
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    sizes = [len(acc.gather_for_metrics(torch.zeros(4))) for _ in loader]
    assert sizes == [4, 4, 2]
