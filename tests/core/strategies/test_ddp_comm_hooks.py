"""DistributedDataParallelKwargs(comm_hook=...): gradients really travel compressed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
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


def _bf16_hook_on_cpu() -> list[str]:
    messages = []
    for hook, wrapper in [("bf16", "no"), ("power_sgd", "bf16"), ("batched_power_sgd", "bf16")]:
        kwargs = DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper)
        try:
            Accelerator(kwargs_handlers=[kwargs])
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    # Not before both processes are connected: torch's init_process_group has no barrier,
    # and a process that tore its group down at once (the end of this body) while the other
    # was still connecting failed the other's connectFullMesh once ("closed by peer").
    dist.barrier()
    return messages


def test_bf16_hooks_need_nccl() -> None:
    # torch's bf16 all-reduce hook and wrapper are NCCL-only (TypeError from inside
    # prepare); slipstream says so when the Accelerator is built. The GPU check
    # (benchmarks/gpu_check.py) covers them on GPUs.
    for messages in run_distributed(_bf16_hook_on_cpu):
        assert len(messages) == 3
        assert all("needs GPUs with NCCL" in m and "use 'fp16' instead" in m for m in messages)


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


# -- Accelerate's test_ddp_comm_hook.py, with its reference DDP built for CPU modules ---------
class MockModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(40, 20))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.p * (x ** (1 + rank))


def _script_grads(model: nn.Module, rank: int) -> torch.Tensor:
    torch.manual_seed(2024)
    model(torch.randn(40, 20), rank).mean().backward()
    return next(model.parameters()).grad


def _accelerate_script_cases(cases: list) -> list[str]:
    from slipstream.utils import DDPCommunicationHookType as Hook

    failures = []
    for hook, wrapper, option in cases:
        kwargs = DistributedDataParallelKwargs(
            comm_hook=Hook(hook), comm_wrapper=Hook(wrapper), comm_state_option=option
        )
        accelerator = Accelerator(kwargs_handlers=[kwargs])
        model = accelerator.prepare(MockModel())
        hooked = _script_grads(model, accelerator.local_process_index)
        # The script passes device_ids=[rank]: torch accepts that for GPU modules only.
        reference = nn.parallel.DistributedDataParallel(MockModel().to(accelerator.device))
        expected = _script_grads(reference, accelerator.local_process_index)
        try:
            torch.testing.assert_close(hooked, expected, rtol=1e-2, atol=1e-2)
        except AssertionError as error:
            failures.append(f"{hook}/{wrapper}: {error}")
    return failures


def test_accelerate_comm_hook_script_cases_without_bf16() -> None:
    cases = [
        ("no", "no", {}),
        ("fp16", "no", {}),
        ("power_sgd", "no", {}),
        ("power_sgd", "fp16", {}),
        ("power_sgd", "no", {"matrix_approximation_rank": 2}),
        ("batched_power_sgd", "no", {}),
        ("batched_power_sgd", "fp16", {}),
    ]
    assert run_distributed(_accelerate_script_cases, cases) == [[], []]
