"""Pipeline schedules with every receive posted when the step starts (gloo), run by
slipstream's action runner over the local Unix-socket transport: the same gradients,
weights and losses as torch's own schedules, bit for bit, for every schedule."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.parallel.config_values import PIPELINE_SCHEDULES
from slipstream.parallel.pipeline.receives import compute_order
from slipstream.parallel.pipeline.runner import ActionRunner
from slipstream.parallel.pipeline.runtime import PipelineRuntime, resolve_plan
from tests.distributed import run_distributed

WIDTH, BLOCKS, MICROBATCHES, STEPS = 8, 4, 4, 2


def _stages(
    blocks: nn.Sequential, name: str, early: bool
) -> tuple[PipelineRuntime, list[nn.Module]]:
    from torch.distributed.pipelining import PipelineStage

    plan = resolve_plan(2, name, MICROBATCHES, None)
    per_stage = BLOCKS // plan.num_stages
    modules = {
        index: copy.deepcopy(blocks[index * per_stage : (index + 1) * per_stage])
        for index in plan.stages_of(dist.get_rank())
    }
    stages = [
        PipelineStage(module, index, plan.num_stages, torch.device("cpu"))
        for index, module in modules.items()
    ]
    return PipelineRuntime(stages, None, plan, early_receives=early), list(modules.values())


def _train(name: str, early: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )
    runtime, modules = _stages(blocks, name, early)
    parameters = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses, gradients = [], []
    for _ in range(STEPS):
        x = torch.randn(2 * MICROBATCHES, WIDTH, generator=generator)
        y = torch.randn(2 * MICROBATCHES, WIDTH, generator=generator)
        losses.append(runtime.train((x,), y, F.mse_loss, lambda loss: loss))
        gradients.append([p.grad.clone() for p in parameters])
        optimizer.step()
        optimizer.zero_grad()
    lowered = getattr(runtime.schedule, "pipeline_order_with_comms", {})
    order = [str(action) for action in lowered.get(dist.get_rank(), [])]
    return {
        "early": runtime.early_receives,
        "runner": isinstance(runtime.schedule._step_microbatches, ActionRunner),
        "local": runtime.channels is not None,
        "losses": losses,
        "gradients": gradients,
        "weights": [p.detach().clone() for p in parameters],
        "order": order,
    }


def _every_schedule() -> dict[str, Any]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    results = {}
    for name in PIPELINE_SCHEDULES:
        torch_run, early_run = _train(name, early=False), _train(name, early=True)
        results[name] = {
            "early": early_run["early"] and early_run["runner"],
            "torch_is_early": torch_run["early"],
            # Both processes run here: the runner's transfers go over Unix sockets.
            "local": early_run["local"] and not torch_run["local"],
            "same_losses": all(
                torch.equal(a, b)
                for a, b in zip(torch_run["losses"], early_run["losses"], strict=True)
            ),
            "same_gradients": all(
                torch.equal(a, b)
                for step_a, step_b in zip(
                    torch_run["gradients"], early_run["gradients"], strict=True
                )
                for a, b in zip(step_a, step_b, strict=True)
            ),
            "same_weights": all(
                torch.equal(a, b)
                for a, b in zip(torch_run["weights"], early_run["weights"], strict=True)
            ),
            "trained": not all(
                torch.equal(a, b) for a, b in zip(early_run["weights"], _initial(name), strict=True)
            ),
            "order": early_run["order"],
        }
    return results


def _initial(name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blocks = nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )
    _, modules = _stages(blocks, name, early=False)
    return [p.detach() for module in modules for p in module.parameters()]


def test_early_receives_train_bitwise_like_torchs_schedules():
    ranks = run_distributed(_every_schedule, world_size=2, timeout=240)
    for rank, results in enumerate(ranks):
        assert set(results) == set(PIPELINE_SCHEDULES)
        for name, result in results.items():
            assert result["early"] and not result["torch_is_early"], (rank, name)
            assert result["local"], (rank, name)
            assert result["trained"], (rank, name)
            assert result["same_losses"], (rank, name)
            assert result["same_gradients"], (rank, name)
            assert result["same_weights"], (rank, name)
            # Every receive comes before the first computation.
            kinds = ["RECV" in action for action in result["order"]]
            assert any(kinds), (rank, name, result["order"])
            assert kinds.index(False) == sum(kinds), (rank, name, result["order"])


def test_the_gpipe_and_1f1b_orders_are_torchs():
    gpipe = [str(a) for a in compute_order("gpipe", 1, 2, 3)]
    assert gpipe == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]
    # 1F1B: stage s of p runs p - s forwards first, then a backward and a forward in turn.
    assert [str(a) for a in compute_order("1f1b", 0, 3, 4)] == [
        "0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3",
    ]  # fmt: skip
    assert [str(a) for a in compute_order("1f1b", 2, 3, 4)] == [
        "2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3",
    ]  # fmt: skip
