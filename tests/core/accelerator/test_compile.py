"""torch.compile of prepared models: backends, unwrapping and clear failures."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from slipstream import Accelerator, CompileError, TorchDynamoPlugin
from tests.distributed import run_distributed


def test_compiled_model_trains_and_unwraps_to_the_original():
    acc = Accelerator(dynamo_backend="aot_eager")
    original = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(original.parameters(), lr=0.1)
    model, optimizer = acc.prepare(original, optimizer)
    assert type(model).__name__ == "OptimizedModule"
    before = original.weight.detach().clone()
    acc.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()
    assert not torch.equal(before, original.weight)
    assert acc.unwrap_model(model) is original


def test_forward_backward_looks_through_the_compile_wrapper():
    from slipstream.accelerator.training_step import _without_compile_wrapper

    original = nn.Linear(3, 1)
    compiled = torch.compile(original, backend="eager")
    assert _without_compile_wrapper(compiled) is original
    assert _without_compile_wrapper(original) is original
    plain = object()  # (not a module: returned as it is)
    assert _without_compile_wrapper(plain) is plain
    acc = Accelerator()
    loss = acc.forward_backward(
        compiled, torch.ones(2, 3), target=torch.zeros(2, 1), loss_fn=nn.functional.mse_loss
    )
    assert loss.requires_grad is False and original.weight.grad is not None


def test_a_pipelined_model_is_found_through_the_compile_wrapper():
    from slipstream.parallel.pipeline import pipeline_of

    class Pipeline:  # what forward_backward hands a pipelined model's batch to
        def __init__(self) -> None:
            self.batches: list[tuple[Any, Any]] = []

        def train(self, inputs: Any, target: Any, loss_fn: Any, scale: Any) -> torch.Tensor:
            self.batches.append((inputs, target))
            return torch.tensor(1.5)

    original = nn.Linear(3, 1)
    pipeline = Pipeline()
    original.__dict__.update(_pipeline=pipeline, _pipeline_kind="modules")
    compiled = torch.compile(original, backend="eager")
    assert pipeline_of(original) is pipeline and pipeline_of(compiled) is pipeline
    assert pipeline_of(nn.Linear(3, 1)) is None
    x, y = torch.ones(2, 3), torch.zeros(2, 1)
    loss = Accelerator().forward_backward(compiled, x, target=y, loss_fn=nn.functional.mse_loss)
    assert loss.item() == 1.5 and pipeline.batches == [((x,), y)]


@torch._dynamo.register_backend
def always_fails(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_compile_failure_names_the_backend():
    acc = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="always_fails"))
    model = acc.prepare(nn.Linear(3, 1))
    with pytest.raises(CompileError, match="dynamo_backend='always_fails' failed"):
        model(torch.ones(2, 3))


def test_unknown_backend_is_rejected_at_construction():
    with pytest.raises(ValueError, match="unknown dynamo_backend 'inductr'"):
        Accelerator(dynamo_backend="inductr")
    assert Accelerator(dynamo_backend="NO").dynamo_plugin.backend == "no"


def _compiled_ddp() -> dict:
    acc = Accelerator(dynamo_backend="eager")
    model = acc.prepare(nn.Linear(3, 1))
    with acc.no_sync(model):
        acc.backward(model(torch.ones(2, 3) * (acc.process_index + 1)).sum())
    local = model._orig_mod.module.weight.grad.clone()
    return {"inner": type(acc.unwrap_model(model)).__name__, "local": local.tolist()}


def test_compiled_ddp_model_still_honours_no_sync():
    r0, r1 = run_distributed(_compiled_ddp)
    assert r0["inner"] == "Linear"
    assert r0["local"] != r1["local"], "gradients were not averaged inside no_sync"


def test_inductor_backend_trains_on_cpu():
    acc = Accelerator(dynamo_backend="inductor")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(16, 4)
    first = model(x).pow(2).mean()
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
    assert loss.item() < first.item()


def test_settings_not_given_come_from_accelerate_launchs_variables(monkeypatch):
    assert TorchDynamoPlugin().to_kwargs() == {}
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "reduce-overhead")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    plugin = TorchDynamoPlugin()
    assert plugin.to_kwargs() == {
        "backend": "aot_eager",
        "mode": "reduce-overhead",
        "fullgraph": True,
    }
    assert TorchDynamoPlugin(backend="no").backend == "no"  # an argument wins
    assert Accelerator().dynamo_plugin.backend == "aot_eager"  # started by accelerate launch
