"""BadStepGuard on 2 processes: a NaN on one process skips the step on both; a loss spike
rolls back to the last checkpoint, and the final weights equal those of a run that never
saw the offending batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, BadStepGuard, ProjectConfiguration
from tests.distributed import run_distributed

STEPS = 12
BATCH = 4  # per process


def _data(spike_at: int | None) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH * 2, 6, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    if spike_at is not None:  # both processes' shares of that global batch are broken
        rows = slice(spike_at * BATCH * 2, (spike_at + 1) * BATCH * 2)
        y[rows] = y[rows] * 1000.0
    return TensorDataset(x, y)


def _setup(accelerator: Accelerator, spike_at: int | None) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(_data(spike_at), batch_size=BATCH, shuffle=False)
    return accelerator.prepare(model, optimizer, loader)


def _nan_job(guarded: bool) -> dict:
    guard = BadStepGuard(max_bad_steps=None)
    accelerator = Accelerator(callbacks=[guard] if guarded else [])
    model, optimizer, loader = _setup(accelerator, None)
    for index, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if index == 3 and accelerator.process_index == 1:
            loss = loss * float("nan")  # one process only
        if not guarded and index == 3:
            optimizer.zero_grad()  # the reference skips that step by hand
            continue
        accelerator.backward(loss)
        optimizer.step()
        if index == 3:
            assert accelerator.optimizer_step_was_skipped
        optimizer.zero_grad()
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {"weights": weights, "skipped": guard.skipped_steps, "step": accelerator.step}


def test_a_nan_on_one_process_skips_the_step_on_all():
    guarded = run_distributed(_nan_job, True)
    reference = run_distributed(_nan_job, False)
    assert [r["skipped"] for r in guarded] == [1, 1]
    assert [r["step"] for r in guarded] == [STEPS - 1] * 2
    for result in guarded:
        assert torch.isfinite(result["weights"]).all()
        assert torch.equal(result["weights"], reference[0]["weights"])


def _spike_job(project: str, spike_at: int, guarded: bool) -> dict:
    guard = BadStepGuard(max_bad_steps=None, spike_factor=20.0)
    accelerator = Accelerator(
        callbacks=[guard] if guarded else [],
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True),
    )
    model, optimizer, loader = _setup(accelerator, spike_at)
    batches = guard.iterate(loader) if guarded else loader
    seen = 0
    for index, (x, y) in enumerate(batches):
        if not guarded and index == spike_at:
            continue  # the reference never sees the offending batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen += 1
        if accelerator.step % 4 == 0 and not accelerator.optimizer_step_was_skipped:
            accelerator.save_state()
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {"weights": weights, "rollbacks": guard.rollbacks, "skipped": guard.skipped_steps}


@pytest.mark.parametrize("spike_at", [6])
def test_a_spike_rolls_back_and_ends_as_if_the_batch_was_never_seen(tmp_path: Path, spike_at):
    guarded = run_distributed(_spike_job, str(tmp_path / "guarded"), spike_at, True)
    reference = run_distributed(_spike_job, str(tmp_path / "reference"), spike_at, False)
    assert [r["rollbacks"] for r in guarded] == [1, 1]
    assert [r["skipped"] for r in guarded] == [1, 1]
    for result in guarded:
        assert torch.equal(result["weights"], reference[0]["weights"]), (
            result["weights"] - reference[0]["weights"]
        )


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        BadStepGuard(window=0)
    with pytest.raises(ValueError):
        BadStepGuard(spike_factor=0.5)


def _sharded_nan_job(layout: str) -> dict:
    from slipstream import FullyShardedDataParallelPlugin, ParallelismConfig

    guard = BadStepGuard(max_bad_steps=None)
    if layout == "tp":
        plan = {"0": "colwise", "1": "rowwise"}
        config = ParallelismConfig(tp_size=2, tp_plan=plan)
        accelerator = Accelerator(callbacks=[guard], parallelism_config=config)
    else:
        plugin = FullyShardedDataParallelPlugin()
        accelerator = Accelerator(callbacks=[guard], fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    skipped = []
    for index in range(5):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if index == 2 and accelerator.process_index == 1:
            loss = loss * float("nan")  # one process only: its shard, or its TP half
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
    weights = accelerator.get_state_dict(model)
    finite = all(bool(torch.isfinite(value).all()) for value in weights.values())
    return {"skipped": skipped, "finite": finite, "step": accelerator.step}


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_a_nan_on_one_process_is_skipped_under_sharding(layout: str):
    for result in run_distributed(_sharded_nan_job, layout):
        assert result["skipped"] == [False, False, True, False, False]
        assert result["finite"] and result["step"] == 4


def _recurring_nan_job(project: str, save: bool) -> dict:
    # A divergence the data does not cause: the loss is NaN at step 5 whatever the batch.
    # Each rollback (to step 4) leaves out more batches and meets it again: after 3 that
    # made no progress, every process stops with the error instead of eating the data.
    from slipstream import BadStepError

    guard = BadStepGuard(max_bad_steps=2)
    accelerator = Accelerator(
        callbacks=[guard],
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x = torch.randn(80 * BATCH, 6, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = 0
    try:
        for x, y in guard.iterate(loader):
            batches += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            if accelerator.step == 5:
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if save and accelerator.step % 2 == 0 and not accelerator.optimizer_step_was_skipped:
                accelerator.save_state()
    except BadStepError as error:
        return {"error": str(error), "rollbacks": guard.rollbacks, "batches": batches}
    return {"error": None, "step": accelerator.step, "batches": batches}


def test_rollbacks_that_make_no_progress_stop_every_process(tmp_path: Path):
    results = run_distributed(_recurring_nan_job, str(tmp_path), True)
    for result in results:
        assert result["error"] is not None, f"the run ended without an error: {result}"
        # 3 rollbacks (the default limit), then the 4th call for one stops: far from the
        # 40 batches a process has.
        assert result["rollbacks"] == 3 and result["batches"] < 20, result
        message = result["error"]
        assert "stopped the run at step 5" in message
        assert "after 3 rollback(s) in a row that made no progress" in message
        assert "lower the learning rate" in message
        assert "max_rollbacks_without_progress=6" in message
    assert results[0]["error"] == results[1]["error"]


def test_no_checkpoint_to_go_back_to_stops_too(tmp_path: Path):
    from slipstream import BadStepError

    results = run_distributed(_recurring_nan_job, str(tmp_path), False)
    for result in results:
        assert "no committed checkpoint to go back to" in str(result["error"]), result
    with pytest.raises(ValueError, match="max_rollbacks_without_progress"):
        BadStepGuard(max_rollbacks_without_progress=0)
    assert issubclass(BadStepError, RuntimeError)
