"""Callbacks in plain scripts on 2 CPU processes: hook order, counts, checkpoint state."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import (
    Accelerator,
    Callback,
    CallbackError,
    EarlyStopping,
    GradientNormMonitor,
    ThroughputMonitor,
)
from slipstream.tracking import GeneralTracker
from tests.distributed import run_distributed


class Recorder(Callback):
    """Records every hook it sees, in order (not every hook: only the ones defined here)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.restored: dict = {}

    def on_before_backward(self, accelerator, loss):
        self.events.append("before_backward")

    def on_after_backward(self, accelerator):
        self.events.append("after_backward")

    def on_before_optimizer_step(self, accelerator, optimizer):
        self.events.append("before_step")

    def on_after_optimizer_step(self, accelerator, optimizer):
        self.events.append("after_step")

    def on_before_zero_grad(self, accelerator, optimizer):
        self.events.append("zero_grad")

    def on_dataloader_epoch_end(self, accelerator, dataloader):
        self.events.append("epoch_end")

    def on_validation_epoch_end(self, accelerator, metrics):
        self.events.append(f"validation:{metrics['score']}")

    def on_save_checkpoint(self, accelerator, checkpoint):
        checkpoint["seen"] = len(self.events)

    def on_load_checkpoint(self, accelerator, checkpoint):
        self.restored = dict(checkpoint)


class Plain:
    """Not a Callback subclass: only the hooks it defines are called."""

    def __init__(self) -> None:
        self.train_end = 0

    def on_train_end(self, accelerator):
        self.train_end += 1


def _loop(folder: str, accumulation: int) -> dict:
    recorder, plain = Recorder(), Plain()
    acc = Accelerator(callbacks=[recorder, plain], gradient_accumulation_steps=accumulation)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    acc.call("on_validation_epoch_end", metrics={"score": 7})
    acc.save_state(folder)
    seen = len(recorder.events)
    recorder.events.append("after-save")
    acc.load_state(folder)
    acc.end_training()
    return {
        "events": recorder.events,
        "restored": recorder.restored,
        "seen": seen,
        "train_end": plain.train_end,
    }


def test_hooks_fire_in_order_once_per_step_on_every_rank(tmp_path):
    results = run_distributed(_loop, str(tmp_path / "ckpt"), 2)
    for result in results:
        events = result["events"]
        counts = Counter(events)
        # 16 samples / 2 processes / batch 2 = 4 micro-steps; accumulation 2 -> 2 steps.
        assert counts["before_backward"] == counts["after_backward"] == 4
        assert counts["before_step"] == counts["after_step"] == counts["zero_grad"] == 2
        assert counts["epoch_end"] == 1
        assert events[:5] == [
            "before_backward",
            "after_backward",
            "before_backward",
            "after_backward",
            "before_step",
        ]
        assert "validation:7" in events
        assert result["restored"] == {"seen": result["seen"]}, "callback state round-trips"
        assert result["train_end"] == 1


class Exploding(Callback):
    def on_after_backward(self, accelerator):
        raise ZeroDivisionError("oops")


def test_a_failing_callback_is_named():
    acc = Accelerator(callbacks=[Exploding()])
    model = acc.prepare(nn.Linear(2, 1))
    with pytest.raises(
        CallbackError,
        match="callback Exploding failed in on_after_backward: ZeroDivisionError: oops",
    ):
        acc.backward(model(torch.ones(1, 2)).sum())


class Sink(GeneralTracker):
    name = "sink"

    def __init__(self) -> None:
        super().__init__()
        self.logged: list = []

    def log(self, values, step=None, **kwargs):
        self.logged.append(values)


def _monitors() -> dict:
    throughput, norms = ThroughputMonitor(log_every_n_steps=2), GradientNormMonitor()
    stopper = EarlyStopping(monitor="val_loss", patience=2)
    sink = Sink()
    acc = Accelerator(callbacks=[throughput, norms, stopper], log_with=sink)
    acc.init_trackers("monitors")
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    reference_norms = []
    for x, y in loader:
        acc.backward(F.mse_loss(model(x), y))
        params = list(model.parameters())
        reference_norms.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        )
        optimizer.step()
        optimizer.zero_grad()
    # Validation losses differ per rank; their mean is what decides: improves, then not.
    stops = []
    for epoch, losses in enumerate([(1.0, 3.0), (0.5, 1.5), (0.9, 1.5), (0.9, 1.5)]):
        acc.log({"val_loss": losses[acc.process_index]}, step=epoch)
        stops.append(stopper.should_stop)
    return {
        "samples_per_second": throughput.last_values.get("throughput/samples_per_second"),
        "last_norm": norms.last_norm,
        "reference_norm": reference_norms[-1],
        "stops": stops,
        "trigger": acc.check_trigger(),
        "logged_keys": sorted({k for values in sink.logged for k in values}),
    }


def test_builtin_monitors_and_early_stopping_across_ranks():
    r0, r1 = run_distributed(_monitors)
    for result in (r0, r1):
        assert result["samples_per_second"] and result["samples_per_second"] > 0
        assert abs(result["last_norm"] - result["reference_norm"]) < 1e-6
        assert result["stops"] == [False, False, False, True]
        assert result["trigger"] is True
    assert r0["logged_keys"] == [
        "grad_norm",
        "throughput/flops_per_second",  # counted once with FlopCounterMode (no peak on CPU)
        "throughput/flops_per_step",
        "throughput/samples_per_second",
        "throughput/step_seconds",
        "val_loss",
    ]
    assert r1["logged_keys"] == [], "only the main process has trackers"
