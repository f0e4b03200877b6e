"""Mixed precision: fp16 loss scaling and skipped steps, bf16, true half, fp8 errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, AutocastKwargs, GradScalerKwargs, set_seed
from slipstream.precision import canonical_mode, make_precision
from tests.distributed import run_distributed


def _fp16_overflow() -> dict:
    # A modest initial scale: the default 2**16 overflows fp16 on this model's first step.
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    set_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    history = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).float().pow(2).mean()
        if step == 1 and acc.process_index == 1:
            loss = loss * float("inf")  # overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        history.append(
            {
                "skipped": acc.optimizer_step_was_skipped,
                "unchanged": unchanged,
                "lr": optimizer.param_groups[0]["lr"],
                "scale": acc.scaler.get_scale(),
            }
        )
    return {"history": history, "steps": acc.step}


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for result in run_distributed(_fp16_overflow):
        first, overflow, after = result["history"]
        assert not first["skipped"] and not first["unchanged"]
        assert overflow["skipped"] and overflow["unchanged"]
        assert overflow["lr"] == first["lr"], "the scheduler does not advance on a skipped step"
        assert overflow["scale"] == first["scale"] / 2
        assert not after["skipped"] and after["lr"] == first["lr"] * 0.25
        assert result["steps"] == 2


def _train(precision: str) -> dict:
    acc = Accelerator(mixed_precision=precision)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator) + 0.1
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for _ in range(6):
        for inputs, targets in loader:
            optimizer.zero_grad()
            outputs = model(inputs)
            assert outputs.dtype == torch.float32
            loss = F.mse_loss(outputs, targets)
            acc.backward(loss)
            optimizer.step()
            losses.append(acc.reduce(loss.detach(), "mean").item())
    return {"first": losses[0], "last": sum(losses[-8:]) / 8}


def _fp32_and_bf16() -> dict:
    return {"fp32": _train("no"), "bf16": _train("bf16")}


def test_bf16_converges_like_fp32_on_two_processes():
    result = run_distributed(_fp32_and_bf16)[0]
    fp32, bf16 = result["fp32"], result["bf16"]
    assert fp32["last"] < fp32["first"] / 20
    assert bf16["last"] < bf16["first"] / 20
    assert abs(bf16["last"] - fp32["last"]) < 0.05 * fp32["first"]


def test_autocast_context_and_options():
    acc = Accelerator(mixed_precision="bf16")
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with acc.autocast(enabled=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    raw = Accelerator(
        mixed_precision="bf16",
        kwargs_handlers=[AutocastKwargs(convert_outputs_to_fp32=False)],
    )
    assert raw.prepare(nn.Linear(2, 2))(torch.ones(1, 2)).dtype == torch.bfloat16


def test_autocast_takes_accelerates_handler_for_one_block():
    acc = Accelerator(mixed_precision="bf16")
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with acc.autocast(autocast_handler=AutocastKwargs(cache_enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()
    with acc.autocast():
        assert torch.is_autocast_cache_enabled()


def test_rng_types_are_accepted_and_global_ones_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Accelerator(rng_types=["generator"])  # what seeded shuffles already give: silent
    with pytest.warns(UserWarning, match=r"synchronize_rng_states\(\['cuda', 'torch'\]\)"):
        Accelerator(rng_types=["torch", "cuda"])


def test_grad_scaler_options():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    assert acc.scaler.get_scale() == 1024.0
    assert Accelerator(mixed_precision="bf16").scaler is None


def test_true_bf16_stores_weights_in_bf16_and_trains():
    acc = Accelerator(mixed_precision="bf16-true")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    assert next(model.parameters()).dtype == torch.bfloat16
    before = model.weight.detach().clone()
    out = model(torch.ones(3, 4))  # fp32 inputs are cast to the weights' dtype
    assert out.dtype == torch.float32
    acc.backward(out.sum())
    assert model.weight.grad.dtype == torch.bfloat16
    optimizer.step()
    assert not torch.equal(before, model.weight)
    assert acc.mixed_precision == "bf16-true"


@pytest.mark.parametrize(
    "spelling,canonical",
    [
        ("bf16-mixed", "bf16"),
        ("16-mixed", "fp16"),
        ("16-true", "fp16-true"),
        ("32", "no"),
        (None, "no"),
    ],
)
def test_lightning_spellings_are_accepted(spelling, canonical):
    assert canonical_mode(spelling) == canonical


def test_precision_errors_are_clear():
    with pytest.raises(ValueError, match="unknown mixed_precision 'bf17'"):
        Accelerator(mixed_precision="bf17")
    with pytest.raises(ValueError, match="does not support on device type 'meta'"):
        make_precision("fp16", torch.device("meta"))
    with pytest.raises(ValueError, match=r"fp8.*(torchao|CUDA GPU)"):
        Accelerator(mixed_precision="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_on_cuda_scales_and_steps():
    acc = Accelerator(mixed_precision="fp16")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.ones(2, 4, device=acc.device)).sum())
    optimizer.step()
    assert not acc.optimizer_step_was_skipped and acc.scaler.get_scale() == 65536.0


def _fp8_supported() -> bool:
    from slipstream.precision import fp8_unavailable_reason

    return torch.cuda.is_available() and fp8_unavailable_reason(torch.device("cuda", 0)) is None


@pytest.mark.skipif(not _fp8_supported(), reason="needs torchao and an fp8 GPU")
def test_fp8_trains_on_a_supporting_gpu():
    acc = Accelerator(mixed_precision="fp8")
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    assert "Float8Linear" in type(acc.unwrap_model(model)[0]).__name__
    acc.backward(model(torch.randn(32, 32, device=acc.device)).float().pow(2).mean())
    optimizer.step()


def test_fp16_with_two_optimizers_unscales_each_once_and_updates_the_scale_once():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    first, second = nn.Linear(3, 1), nn.Linear(3, 1)
    opt_a = torch.optim.SGD(first.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(second.parameters(), lr=0.5)
    first, second, opt_a, opt_b = acc.prepare(first, second, opt_a, opt_b)
    x = torch.ones(2, 3)
    loss = first(x).sum() + second(x).sum()
    acc.backward(loss)
    acc.clip_grad_norm_(list(first.parameters()) + list(second.parameters()), 1e9)
    grads = [m.weight.grad.clone() for m in (first, second)]  # unscaled by the clip
    before = [m.weight.detach().clone() for m in (first, second)]
    opt_a.step()
    opt_b.step()
    for weight, old, grad in zip((first.weight, second.weight), before, grads, strict=True):
        assert torch.allclose(weight, old - 0.5 * grad), "each optimizer unscaled exactly once"
    assert grads[0].abs().max() < 10, "gradients are unscaled, not multiplied by 256"
    assert acc.step == 1 and not acc.optimizer_step_was_skipped
    assert acc.scaler._get_growth_tracker() == 1, "one loss-scale update per step"


def test_backward_calls_loss_scaling_and_strategy_backward_only_where_they_act():
    from slipstream.precision import Precision
    from slipstream.strategies import get_strategy_class

    # The training step skips these calls when a class does not override them.
    assert not Precision.scales_loss and make_precision("fp16", torch.device("cpu")).scales_loss
    assert get_strategy_class("ddp").plain_backward
    assert not get_strategy_class("deepspeed").plain_backward

    calls = []

    class Recording(Precision):
        def scale_loss(self, loss):
            calls.append("scale")
            return loss * 2

    acc = Accelerator()
    acc.precision = Recording(torch.device("cpu"))
    weight = torch.ones(1, requires_grad=True)
    acc.backward((weight * 3).sum())
    assert calls == ["scale"] and weight.grad.item() == 6.0


def test_one_optimizer_steps_count_and_callbacks_still_fire():
    seen = []

    class Hooks:
        def on_before_optimizer_step(self, accelerator, optimizer):
            seen.append("before")

        def on_after_optimizer_step(self, accelerator, optimizer):
            seen.append("after")

    for callbacks in ([], [Hooks()]):
        acc = Accelerator(callbacks=callbacks)
        model = nn.Linear(2, 1)
        optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
        for _ in range(3):
            optimizer.zero_grad()
            acc.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
        assert acc.step == 3 and not acc.optimizer_step_was_skipped
    assert seen == ["before", "after"] * 3
