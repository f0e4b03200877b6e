"""Gradient accumulation and clipping on 2 CPU processes, against single-process references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, GradientAccumulationPlugin, GradScalerKwargs, set_seed
from tests.distributed import run_distributed

MICRO = 2  # samples per process per micro-batch


def _dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, 6, generator=generator),
        torch.randn(samples, 1, generator=generator),
        torch.arange(samples),
    )


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


def _accumulate_against_big_batches(samples: int, steps: int, average: bool = False) -> dict:
    plugin = GradientAccumulationPlugin(num_steps=steps, average_short_cycles=average)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    set_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.99**s)
    loader = DataLoader(_dataset(samples), batch_size=MICRO, shuffle=True)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)

    ddp = model
    all_reduces = {"count": 0}

    def counting_hook(state, bucket):
        all_reduces["count"] += 1
        return (
            dist.all_reduce(bucket.buffer().div_(acc.num_processes), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0])
        )

    ddp.register_comm_hook(None, counting_hook)
    cycles, current, syncs, counts = [], [], [], []
    for _ in range(2):
        for x, y, index in loader:
            with acc.accumulate(model):
                loss = F.mse_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            current.append(acc.gather(index))
            syncs.append(acc.sync_gradients)
            counts.append(all_reduces["count"])
            if acc.sync_gradients:
                cycles.append(torch.cat(current))
                current = []

    # Reference: one process, one batch per optimizer step made of the same samples; a short
    # cycle's mean loss is scaled by its share of a full cycle unless averaged exactly.
    data = _dataset(samples)
    full_cycle = steps * acc.num_processes * MICRO
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.99**s)
    for indices in cycles:
        ref_opt.zero_grad()
        share = 1.0 if average else len(indices) / full_cycle
        loss = F.mse_loss(reference(data.tensors[0][indices]), data.tensors[1][indices])
        (loss * share).backward()
        ref_opt.step()
        for _ in range(acc.num_processes):
            ref_sched.step()
    trained = acc.unwrap_model(model)
    return {
        "max_diff": max(
            (a - b).abs().max().item()
            for a, b in zip(trained.parameters(), reference.parameters(), strict=True)
        ),
        "syncs": syncs,
        "counts": counts,
        "cycle_sizes": [len(c) for c in cycles],
        "optimizer_steps": acc.step,
        "lr": optimizer.param_groups[0]["lr"],
        "ref_lr": ref_opt.param_groups[0]["lr"],
    }


def test_two_processes_accumulating_four_match_one_big_batch():
    # 64 samples: 16 micro-batches of 2 per process per epoch, 4 cycles of 4.
    r0, r1 = run_distributed(_accumulate_against_big_batches, 64, 4)
    assert r0["cycle_sizes"] == [16] * 8, "each step covers 2 processes x 4 x 2 samples"
    assert r0["max_diff"] < 1e-6 and r1["max_diff"] < 1e-6
    assert r0["optimizer_steps"] == 8
    assert r0["syncs"] == ([False] * 3 + [True]) * 8
    assert abs(r0["lr"] - r0["ref_lr"]) < 1e-12


def test_no_communication_between_sync_steps():
    r0, _ = run_distributed(_accumulate_against_big_batches, 64, 4)
    counts, syncs = r0["counts"], r0["syncs"]
    per_sync = counts[3]
    assert per_sync >= 1
    for step, (count, synced) in enumerate(zip(counts, syncs, strict=True)):
        before = counts[step - 1] if step else 0
        assert (count - before) == (per_sync if synced else 0), f"micro-step {step}"


def test_a_short_final_cycle_is_divided_by_num_steps_as_in_accelerate():
    # 40 samples: 10 micro-batches per process per epoch = cycles of 4, 4 and a final cycle
    # of 2 whose losses are divided by 4 (half the update of its big batch), as Accelerate.
    r0, _ = run_distributed(_accumulate_against_big_batches, 40, 4)
    assert r0["cycle_sizes"] == [16, 16, 8] * 2
    assert r0["max_diff"] < 1e-6


def test_average_short_cycles_averages_a_short_cycle_over_what_it_has():
    # The same 40 samples: with average_short_cycles the final cycle of 2 matches its big batch.
    r0, _ = run_distributed(_accumulate_against_big_batches, 40, 4, True)
    assert r0["cycle_sizes"] == [16, 16, 8] * 2
    assert r0["max_diff"] < 1e-6


def _clipping(precision: str) -> dict:
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=[GradScalerKwargs(init_scale=128)])
    set_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    data = _dataset(8)
    mine = slice(acc.process_index * 4, acc.process_index * 4 + 4)
    optimizer.zero_grad()
    acc.backward(F.mse_loss(model(data.tensors[0][mine]), data.tensors[1][mine]))
    params = list(model.parameters())
    if precision == "fp16":
        acc.unscale_gradients()  # then clip: must not unscale twice
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    norm = acc.clip_grad_norm_(params, max_norm=0.01).item()
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    acc.clip_grad_value_(params, 1e-4)
    largest = max(p.grad.abs().max().item() for p in params)
    F.mse_loss(reference(data.tensors[0]), data.tensors[1]).backward()
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    optimizer.step()
    return {
        "norm": norm,
        "expected": expected,
        "after": after,
        "largest": largest,
        "reference_norm": reference_norm,
        "skipped": acc.optimizer_step_was_skipped,
    }


def test_clip_grad_norm_returns_the_global_norm_and_clips():
    for result in run_distributed(_clipping, "no"):
        assert abs(result["norm"] - result["reference_norm"]) < 1e-6 * result["reference_norm"]
        assert abs(result["after"] - 0.01) < 1e-6
        assert result["largest"] <= 1e-4


def test_clipping_under_fp16_unscales_first_and_only_once():
    for result in run_distributed(_clipping, "fp16"):
        assert not result["skipped"]
        assert abs(result["norm"] - result["expected"]) < 1e-5 * result["expected"]
        # fp16 autocast gradients are close to the fp32 ones, not scaled by 128.
        assert abs(result["norm"] - result["reference_norm"]) < 0.05 * result["reference_norm"]
        assert abs(result["after"] - 0.01) < 1e-5


def test_clipping_between_sync_steps_leaves_partial_gradients_alone():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(nn.Linear(3, 1))
    with acc.accumulate(model):
        acc.backward(model(torch.ones(4, 3)).sum())
        before = model.weight.grad.clone()
        norm = acc.clip_grad_norm_(model.parameters(), 1e-6)
        assert torch.equal(model.weight.grad, before) and not acc.sync_gradients
        assert (
            abs(norm.item() - torch.cat([before.flatten(), model.bias.grad]).norm().item()) < 1e-5
        )


# -- GradientAccumulationPlugin ---------------------------------------------------------------


def test_plugin_sets_the_steps_and_refuses_ambiguity() -> None:
    from slipstream.options.kwargs import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=3)
    assert (
        Accelerator(cpu=True, gradient_accumulation_plugin=plugin).gradient_accumulation_steps == 3
    )
    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin)
    with pytest.raises(ValueError, match="needs num_steps"):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin())


@pytest.mark.parametrize("with_dataloader", [True, False])
def test_sync_with_dataloader(with_dataloader: bool) -> None:
    from slipstream.options.kwargs import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=with_dataloader)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = acc.prepare(_model())
    loader = acc.prepare(DataLoader(_dataset(5), batch_size=1))
    syncs = []
    for _ in range(2):
        for _batch in loader:
            with acc.accumulate(model):
                syncs.append(acc.sync_gradients)
    if with_dataloader:  # the end of each epoch ends the cycle
        assert syncs == [False, True, False, True, True] * 2
    else:  # cycles run across epochs
        assert syncs == [False, True] * 5


def _sync_each_batch(each: bool) -> dict:
    from slipstream.options.kwargs import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=each)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    set_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_dataset(16), batch_size=MICRO)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    reductions = {"count": 0}

    def counting_hook(state, bucket):
        reductions["count"] += 1
        return (
            dist.all_reduce(bucket.buffer().div_(acc.num_processes), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0])
        )

    model.register_comm_hook(None, counting_hook)
    for x, y, _index in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {"reductions": reductions["count"], "weights": weights}


def test_sync_each_batch_reduces_every_micro_batch_with_the_same_result() -> None:
    each = run_distributed(_sync_each_batch, True)[0]
    cycle = run_distributed(_sync_each_batch, False)[0]
    assert (each["reductions"], cycle["reductions"]) == (4, 2)  # 4 micro-batches, 2 steps
    for a, b in zip(each["weights"], cycle["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _deepspeed_with_sync_each_batch() -> str:
    from slipstream import DeepSpeedPlugin
    from slipstream.options.kwargs import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    try:
        Accelerator(deepspeed_plugin=DeepSpeedPlugin(), gradient_accumulation_plugin=plugin)
    except ValueError as error:
        return str(error)
    return "no error"


def test_sync_each_batch_is_refused_under_deepspeed() -> None:
    assert "does not apply to DeepSpeed" in run_distributed(_deepspeed_with_sync_each_batch)[0]
