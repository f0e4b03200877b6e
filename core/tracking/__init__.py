"""Experiment tracking: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``.

Example::

    accelerator = Accelerator(log_with=["csv", "tensorboard"], project_dir="runs")
    accelerator.init_trackers("exp1", config={"lr": 1e-3})
    accelerator.log({"loss": loss.item()}, step=accelerator.step)
    accelerator.end_training()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import GeneralTracker
from .builtin import CSVTracker, MLflowTracker, TensorBoardTracker, WandBTracker

TRACKERS: dict[str, type[GeneralTracker]] = {
    tracker.name: tracker
    for tracker in (CSVTracker, TensorBoardTracker, WandBTracker, MLflowTracker)
}


def resolve_log_with(log_with: Any) -> list[str | GeneralTracker]:
    """Normalise ``log_with`` (a name, "all", a tracker, or a list of them); checks names."""
    if log_with is None:
        return []
    items: Sequence[Any] = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[str | GeneralTracker] = []
    for item in items:
        if isinstance(item, GeneralTracker):
            resolved.append(item)
        elif str(item).lower() == "all":
            resolved += [name for name in TRACKERS if _available(name)]
        elif str(item).lower() in TRACKERS:
            resolved.append(str(item).lower())
        else:
            raise ValueError(
                f"unknown tracker {item!r} in log_with; choose from {', '.join(TRACKERS)}, "
                "'all', or pass a GeneralTracker instance"
            )
    return resolved


def _available(name: str) -> bool:
    import importlib.util

    module = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}.get(name)
    return module is None or importlib.util.find_spec(module) is not None


__all__ = [
    "TRACKERS",
    "CSVTracker",
    "GeneralTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "resolve_log_with",
]
