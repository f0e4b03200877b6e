"""DistributedDataParallelKwargs(comm_hook=...): gradients really travel compressed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream import Accelerator, DistributedDataParallelKwargs
from tests.distributed import run_distributed

WIDTH = 16


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 + rank))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(WIDTH, WIDTH, bias=False)


def _local_grad(rank: int) -> torch.Tensor:
    model = _model()
    model(_inputs(rank)).pow(2).sum().backward()
    return model.weight.grad


def _grads(hook: str, options: dict, backwards: int, wrapper: str = "no") -> list[torch.Tensor]:
    kwargs = DistributedDataParallelKwargs(
        comm_hook=hook, comm_wrapper=wrapper, comm_state_option=options
    )
    accelerator = Accelerator(kwargs_handlers=[kwargs])
    model = accelerator.prepare(_model())
    grads = []
    for _ in range(backwards):
        model.zero_grad()
        accelerator.backward(model(_inputs(accelerator.process_index)).pow(2).sum())
        grads.append(accelerator.unwrap_model(model).weight.grad.clone())
    return grads


def test_fp16_hook_averages_in_half_precision() -> None:
    results = run_distributed(_grads, "fp16", {}, 1)
    local = [_local_grad(0), _local_grad(1)]
    exact = (local[0] + local[1]) / 2
    in_half = ((local[0].half() / 2) + (local[1].half() / 2)).float()
    for grads in results:
        torch.testing.assert_close(grads[0], in_half, rtol=0, atol=0)
        assert not torch.equal(grads[0], exact)  # it did travel in half precision


def _bf16_hook_on_cpu() -> str:
    try:
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="bf16")])
    except ValueError as error:
        return str(error)
    return "no error"


def test_bf16_hook_needs_nccl() -> None:
    # torch's bf16 all-reduce hook is NCCL-only; the GPU check (benchmarks/gpu_check.py)
    # covers it on GPUs.
    assert "needs GPUs with NCCL" in run_distributed(_bf16_hook_on_cpu)[0]


def test_power_sgd_with_fp16_wrapper() -> None:
    options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "min_compression_rate": 0}
    results = run_distributed(_grads_wrapped, "power_sgd", "fp16", options, 3)
    for grads in results:
        singular = torch.linalg.svdvals(grads[2])
        assert singular[1] < 1e-2 * singular[0]  # rank 1, up to fp16 rounding
        torch.testing.assert_close(grads[2], results[0][2])


def _grads_wrapped(hook: str, wrapper: str, options: dict, backwards: int) -> list[torch.Tensor]:
    return _grads(hook, options, backwards, wrapper)


def test_power_sgd_sends_low_rank_gradients_after_its_start() -> None:
    options = {
        "matrix_approximation_rank": 1,
        "start_powerSGD_iter": 2,
        "min_compression_rate": 0,
        "use_error_feedback": False,
        "warm_start": False,
    }
    results = run_distributed(_grads, "power_sgd", options, 3)
    exact = (_local_grad(0) + _local_grad(1)) / 2
    torch.testing.assert_close(results[0][0], exact)  # plain all-reduce before the start
    assert torch.linalg.matrix_rank(exact) > 1
    for grads in results:
        assert torch.linalg.matrix_rank(grads[2]) == 1
        torch.testing.assert_close(grads[2], results[0][2])  # every process agrees


def test_bad_hook_options_are_explained() -> None:
    with pytest.raises(ValueError, match="comm_hook='lz4' is not one of"):
        DistributedDataParallelKwargs(comm_hook="lz4")
    with pytest.raises(ValueError, match="comm_wrapper wraps a PowerSGD hook"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_wrapper="bf16")
    with pytest.raises(ValueError, match="a wrapper casts"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
    kwargs = DistributedDataParallelKwargs(comm_hook="batched_power_sgd", comm_wrapper="fp16")
    assert kwargs.ddp_options() == {}


def _bad_state_option() -> str:
    options = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option={"rank": 2})
    accelerator = Accelerator(kwargs_handlers=[options])
    try:
        accelerator.prepare(_model())
    except ValueError as error:
        return str(error)
    return "no error"


def test_unknown_power_sgd_option_is_named() -> None:
    message = run_distributed(_bad_state_option)[0]
    assert "comm_state_option={'rank': 2}" in message and "matrix_approximation_rank" in message
