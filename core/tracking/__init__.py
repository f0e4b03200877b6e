"""Experiment tracking: ``Accelerator(log_with=...)``, ``init_trackers``, ``log``.

Example::

    accelerator = Accelerator(log_with=["csv", "tensorboard"], project_dir="runs")
    accelerator.init_trackers("exp1", config={"lr": 1e-3})
    accelerator.log({"loss": loss.item()}, step=accelerator.step)
    accelerator.end_training()
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .base import GeneralTracker
from .builtin import CSVTracker, MLflowTracker, TensorBoardTracker, WandBTracker

TRACKERS: dict[str, type[GeneralTracker]] = {
    tracker.name: tracker
    for tracker in (CSVTracker, TensorBoardTracker, WandBTracker, MLflowTracker)
}
#: Accelerate's name for the registry of tracker names (the same dict).
LOGGER_TYPE_TO_CLASS = TRACKERS


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with="<tracker_class.name>"`` start ``tracker_class`` (as Accelerate's
    ``register_tracker_class``): it is built as ``tracker_class(project_name, logging_dir,
    **init_kwargs)``, or without ``logging_dir`` when ``requires_logging_directory`` is False.

    Example::

        class PrintTracker(GeneralTracker):
            name, requires_logging_directory = "print", False
            def log(self, values, step=None, **kwargs): print(step, values)

        register_tracker_class(PrintTracker)
        accelerator = Accelerator(log_with="print")
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"tracker_class must be a subclass of GeneralTracker, got {tracker_class!r}"
        )
    name = tracker_class.__dict__.get("name") or ""
    if not name:
        raise ValueError(f"{tracker_class.__name__} must set a `name` (the log_with name)")
    if "requires_logging_directory" not in vars(tracker_class):
        raise ValueError(
            f"{tracker_class.__name__} must set `requires_logging_directory`: True when it "
            "writes into the logging directory, False otherwise"
        )
    if name in TRACKERS:
        warnings.warn(
            f"the tracker name '{name}' is registered already ({TRACKERS[name].__name__}); "
            f"{tracker_class.__name__} replaces it",
            stacklevel=2,
        )
    TRACKERS[name] = tracker_class


def check_logging_directories(
    log_with: list[str | GeneralTracker], logging_dir: str | None
) -> None:
    """Refuse, when the Accelerator is made, trackers named in ``log_with`` that write files
    while no logging directory is set."""
    for entry in log_with:
        if (
            isinstance(entry, str)
            and TRACKERS[entry].requires_logging_directory
            and not logging_dir
        ):
            raise ValueError(
                f"Logging with `{entry}` requires a `logging_dir`: give Accelerator("
                "project_dir=...) or ProjectConfiguration(logging_dir=...)"
            )


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
        elif str(getattr(item, "value", item)) in TRACKERS:
            resolved.append(str(getattr(item, "value", item)))
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
    "LOGGER_TYPE_TO_CLASS",
    "TRACKERS",
    "CSVTracker",
    "GeneralTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "check_logging_directories",
    "register_tracker_class",
    "resolve_log_with",
]
