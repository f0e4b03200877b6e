"""Training on the XLA device (XLA:CPU) matches the same script on the plain CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slipstream import DistributedType
from slipstream.utils import FullyShardedDataParallelPlugin

from .helpers import fresh_accelerator, largest_difference, model_and_data, train, weights


def _run(cpu: bool, **kwargs: object) -> tuple[list[float], dict[str, torch.Tensor], object]:
    clip = kwargs.pop("clip", None)
    accelerator = fresh_accelerator(cpu=cpu, **kwargs)  # type: ignore[arg-type]
    parts = accelerator.prepare(*model_and_data())
    losses = train(accelerator, parts, clip=clip)  # type: ignore[arg-type]
    return losses, weights(accelerator, parts[0]), accelerator


def test_the_accelerator_runs_on_the_xla_device() -> None:
    accelerator = fresh_accelerator()
    assert accelerator.device.type == "xla"
    assert accelerator.distributed_type == DistributedType.XLA
    assert accelerator.state.distributed_type == DistributedType.XLA
    assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
    assert accelerator.is_main_process and accelerator.is_local_main_process
    model, optimizer, loader, _ = accelerator.prepare(*model_and_data())
    assert all(p.device.type == "xla" for p in model.parameters())
    # Moving the model made new parameters: the optimizer updates those.
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {
        id(p) for p in model.parameters()
    }
    inputs, targets = next(iter(loader))
    assert inputs.device.type == "xla" and targets.device.type == "xla"
    accelerator.wait_for_everyone()  # xm.rendezvous
    accelerator.print("printed on the main process")


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_accumulation_steps": 3, "clip": 0.05}],
    ids=["plain", "accumulation_and_clipping"],
)
def test_training_matches_the_cpu(options: dict[str, object]) -> None:
    xla_losses, xla_weights, accelerator = _run(False, **dict(options))
    assert accelerator.device.type == "xla"  # type: ignore[attr-defined]
    cpu_losses, cpu_weights, reference = _run(True, **dict(options))
    assert reference.device.type == "cpu"  # type: ignore[attr-defined]
    assert len(xla_losses) == len(cpu_losses) == 12
    assert max(abs(a - b) for a, b in zip(xla_losses, cpu_losses, strict=True)) <= 1e-5
    assert largest_difference(xla_weights, cpu_weights) <= 1e-5
    # The weights moved (the optimizer really stepped the XLA parameters).
    untrained = model_and_data()[0].state_dict()
    assert largest_difference(xla_weights, {k: v.float() for k, v in untrained.items()}) > 1e-3


def test_clipping_returns_the_norm_before_clipping() -> None:
    accelerator = fresh_accelerator()
    model, _, loader, _ = accelerator.prepare(*model_and_data())
    inputs, targets = next(iter(loader))
    accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
    expected = torch.linalg.vector_norm(
        torch.stack([p.grad.detach().cpu().norm() for p in model.parameters()])
    )
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
    assert norm.device.type == "xla"
    assert abs(float(norm.cpu()) - float(expected)) <= 1e-5
    clipped = torch.linalg.vector_norm(
        torch.stack([p.grad.detach().cpu().norm() for p in model.parameters()])
    )
    assert float(clipped) <= 1e-3 * (1 + 1e-4)


def test_bf16_autocasts_on_the_xla_device_and_trains_close_to_the_cpu() -> None:
    accelerator = fresh_accelerator(mixed_precision="bf16")
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    inner: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, output: inner.append(output.dtype))
    output = model(torch.randn(3, 4, device=accelerator.device))
    assert inner == [torch.bfloat16] and output.dtype == torch.float32

    xla_losses, xla_weights, accelerator = _run(False, mixed_precision="bf16")
    assert accelerator.mixed_precision == "bf16"  # type: ignore[attr-defined]
    cpu_losses, cpu_weights, _ = _run(True, mixed_precision="bf16")
    assert all(torch.isfinite(torch.tensor(xla_losses)))
    # bf16 matmuls round differently on the two backends (and AdamW turns tiny gradient
    # differences into steps of up to lr): the runs stay close, not equal.
    assert max(abs(a - b) for a, b in zip(xla_losses, cpu_losses, strict=True)) <= 2e-2
    assert largest_difference(xla_weights, cpu_weights) <= 0.1


def test_fsdp_on_xla_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="does not run on XLA devices"):
        fresh_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def test_plain_runs_do_not_import_torch_xla() -> None:
    """Installed but not asked for (no PJRT_DEVICE, no --tpu): the CPU, and no torch_xla."""
    code = (
        "import sys, slipstream\n"
        "assert 'torch_xla' not in sys.modules\n"
        "from slipstream import Accelerator\n"
        "a = Accelerator()\n"
        "assert a.device.type == 'cpu', a.device\n"
        "assert 'torch_xla' not in sys.modules\n"
        "print('plain', a.distributed_type)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PJRT_DEVICE"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plain DistributedType.NO" in result.stdout
