"""Ray Train: a slipstream training loop inside ``TorchTrainer`` on a local Ray cluster of
2 CPU workers. The Accelerator joins Ray's process group, metrics and checkpoints go
through Ray's APIs, and after a worker fails Ray's ``FailureConfig`` restarts the run,
which resumes from the last reported checkpoint and ends with the weights of a run that
never failed. Skipped when Ray is not installed or cannot start here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

STEPS = 5
FAIL_AT = 4  # the first attempt's rank 1 raises before this step


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(STEPS * 8, 4, generator=torch.Generator().manual_seed(3))
    return inputs, inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _train_loop(config: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from slipstream import Accelerator
    from slipstream.integrations.ray import RayTracker, in_ray_train, load_checkpoint, report

    assert in_ray_train() and dist.is_initialized()
    group = dist.group.WORLD
    accelerator = Accelerator(cpu=True, log_with=[RayTracker()])
    assert dist.group.WORLD is group  # Ray's process group, joined as it was
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(*_data()), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    resumed = load_checkpoint(accelerator)
    step = accelerator.step_state.optimizer_steps
    if accelerator.is_main_process:
        with open(config["log"], "a") as log:
            log.write(json.dumps({"start": step, "resumed": resumed is not None}) + "\n")
    for x, y in loader:
        if step + 1 == FAIL_AT and resumed is None and accelerator.process_index == 1:
            raise RuntimeError("injected failure")
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accelerator.log({"loss": loss.item()}, step=step)
        report(accelerator, {"step": step})
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.clone() for k, v in weights.items()}, config["weights"])


def _reference() -> dict[str, torch.Tensor]:
    """The same steps on one process: each step's batch is both workers' batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs, targets = _data()
    for step in range(STEPS):
        rows = slice(step * 8, step * 8 + 8)
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def ray_cluster():
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test cluster: no token file
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as error:  # pragma: no cover - depends on the machine
        pytest.skip(f"Ray cannot start here: {error}")
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = saved


@pytest.mark.timeout(180)
def test_a_failed_worker_is_restarted_by_ray_from_the_last_checkpoint(tmp_path: Path, ray_cluster):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log, weights = tmp_path / "log.jsonl", tmp_path / "weights.pt"
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"log": str(log), "weights": str(weights)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(tmp_path / "ray"), name="slipstream",
            failure_config=FailureConfig(max_failures=1),
        ),
    )  # fmt: skip
    result = trainer.fit()
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    assert starts[0] == {"start": 0, "resumed": False}
    assert len(starts) == 2 and starts[1]["resumed"] and 1 <= starts[1]["start"] < FAIL_AT
    assert result.metrics["step"] == STEPS and result.checkpoint is not None
    assert sorted(os.listdir(result.checkpoint.path))  # slipstream's files, in Ray's storage
    final = torch.load(weights)
    for name, value in _reference().items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)
