"""Metrics and checkpoints of a slipstream script through Ray Train's APIs."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, ClassVar

from slipstream.tracking.base import GeneralTracker, scalar


def _ray_train() -> Any:
    try:
        import ray.train
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            'slipstream.integrations.ray needs Ray Train: pip install "slipstream[ray]"'
        ) from error
    return ray.train


def in_ray_train() -> bool:
    """Whether this process is a Ray Train worker (inside ``TorchTrainer``'s loop)."""
    try:
        import ray.train
    except ImportError:
        return False
    try:
        return ray.train.get_context().get_world_size() >= 1
    except Exception:  # outside a training function Ray raises (its type varies by version)
        return False


class RayTracker(GeneralTracker):
    """Send ``accelerator.log(...)`` values to ``ray.train.report`` (they show in Ray's
    results and ``Result.metrics``). Ray Train expects every worker to report, so this
    tracker runs on every process: call ``accelerator.log`` on all of them."""

    name: ClassVar[str] = "ray"
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = False

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {key: scalar(value) for key, value in values.items()}
        if step is not None:
            metrics.setdefault("step", step)
        _ray_train().report(metrics)


def _checkpoint_folder(accelerator: Any) -> str:
    """A folder every process of a machine names alike for this step."""
    try:
        run = _ray_train().get_context().get_experiment_name()
    except Exception:
        run = "run"
    step = accelerator.step_state.optimizer_steps
    return os.path.join(tempfile.gettempdir(), "slipstream-ray", str(run), f"step_{step:09d}")


def report(accelerator: Any, metrics: dict[str, Any], checkpoint: bool = True) -> str | None:
    """Report ``metrics`` to Ray Train, with a checkpoint of the whole training state
    (``accelerator.save_state``) unless ``checkpoint`` is False. Call on every process.

    The state is written to a local folder, handed to Ray (which copies it to the run's
    storage; one process per machine hands over that machine's files) and removed. Returns
    the local folder it was written to (``None`` without a checkpoint)."""
    train = _ray_train()
    values = {key: scalar(value) for key, value in metrics.items()}
    if not checkpoint:
        train.report(values)
        return None
    folder = _checkpoint_folder(accelerator)
    local_main = accelerator.local_process_index == 0
    if local_main:
        shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers
    accelerator.wait_for_everyone()
    accelerator.save_state(folder)
    handed = train.Checkpoint.from_directory(folder) if local_main else None
    name = f"checkpoint_{accelerator.step_state.optimizer_steps:09d}"
    train.report(values, checkpoint=handed, checkpoint_dir_name=name)
    accelerator.wait_for_everyone()
    if local_main:
        shutil.rmtree(folder, ignore_errors=True)
    return folder


def load_checkpoint(accelerator: Any) -> str | None:
    """Restore the last checkpoint Ray Train has for this run (after ``FailureConfig``
    restarted it, or ``TorchTrainer(resume_from_checkpoint=...)``) into the prepared
    objects; returns where it came from, or ``None`` on a fresh start."""
    checkpoint = _ray_train().get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        accelerator.load_state(folder)
        return str(checkpoint.path)
