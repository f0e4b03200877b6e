"""ThroughputMonitor's model FLOPs and MFU: the formula for a tiny Llama equals torch's
FlopCounterMode count; other models are counted once; the figures reach the trackers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from slipstream import Accelerator, ThroughputMonitor
from slipstream.diagnostics.flops import (
    linear_weights,
    measure_peak_flops,
    peak_flops,
    peak_for_name,
    transformer_flops_per_token,
)

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    # Eager attention: torch's CPU flash-attention kernel has no FLOP formula in
    # FlopCounterMode (it would count only the linear layers).
    model.config._attn_implementation = "eager"
    return model


class Recorder:
    def __init__(self) -> None:
        self.logged: list[dict] = []

    def on_log(self, accelerator, values, step) -> None:
        self.logged.append(dict(values))


def test_the_tiny_llama_formula_equals_flop_counter_mode():
    model = _llama()
    batch, sequence = 3, 16
    ids = torch.randint(0, 128, (batch, sequence))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    per_token = transformer_flops_per_token(model, sequence)
    assert per_token is not None
    assert per_token * batch * sequence == counter.get_total_flops()


def test_the_llama_figures_reach_the_trackers():
    monitor, recorder = ThroughputMonitor(log_every_n_steps=2, peak_flops=1e12), Recorder()
    accelerator = Accelerator(callbacks=[monitor, recorder])
    model = _llama()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    ids = torch.randint(0, 128, (2, 8))
    for _ in range(5):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    values = [v for v in recorder.logged if "throughput/step_seconds" in v][-1]
    flops = transformer_flops_per_token(accelerator.unwrap_model(model), 8) * 16
    assert values["throughput/flops_per_step"] == flops
    seconds = values["throughput/step_seconds"]
    assert values["throughput/tokens_per_second"] == pytest.approx(16 / seconds)
    assert values["throughput/flops_per_second"] == pytest.approx(flops / seconds)
    assert values["throughput/mfu"] == pytest.approx(flops / seconds / 1e12)


def test_a_plain_model_is_counted_once_with_flop_counter_mode(caplog):
    caplog.set_level(logging.INFO, logger="slipstream.monitors")  # (pytest's logging is on)
    monitor, recorder = ThroughputMonitor(log_every_n_steps=2), Recorder()
    accelerator = Accelerator(callbacks=[monitor, recorder])
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    weights = linear_weights(model)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(6):
        accelerator.backward(model(torch.randn(5, 32)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    values = [v for v in recorder.logged if "throughput/step_seconds" in v][-1]
    # 2 FLOPs per weight and sample forward, 4 backward (the input's and the weight's
    # gradients), but no input gradient for the first layer: its input needs none.
    first = 32 * 64
    assert values["throughput/flops_per_step"] == (6 * weights - 2 * first) * 5
    assert "throughput/mfu" not in values, "no peak for a CPU unless given or measured"
    assert "throughput/tokens_per_second" not in values
    assert monitor.last_values == values
    # No tracker: the monitor says so once and prints a short line per window.
    said = [r.getMessage() for r in caplog.records if r.name == "slipstream.monitors"]
    assert said[0].startswith("ThroughputMonitor: no tracker to log to"), said
    assert [line.split(":")[0] for line in said[1:]] == [
        "throughput at step 4",
        "throughput at step 6",
    ]
    assert all("s/step" in line and "FLOP/s per device" in line for line in said[1:]), said


def test_the_peak_table():
    assert peak_for_name("NVIDIA H200", "bf16") == 989.4e12
    assert peak_for_name("NVIDIA H100 PCIe", "bf16") == 756.0e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "tf32") == 156.0e12
    assert peak_for_name("NVIDIA A10G", "bf16") == 70.0e12
    assert peak_for_name("AMD Instinct MI300X", "bf16") == 1307.4e12
    assert peak_for_name("NVIDIA B200", "fp32") == 80.0e12
    assert peak_for_name("Some CPU") is None
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert measure_peak_flops("cpu", size=128, seconds=0.05) > 1e6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_known_gpu_has_a_peak():  # pragma: no cover - GPU machines
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    if peak_for_name(name) is None:
        pytest.skip(f"{name} is not in the table")
    assert peak_flops(device, "bf16") == peak_for_name(name, "bf16")
