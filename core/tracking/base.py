"""GeneralTracker: the interface every experiment tracker implements.

Subclass it for a custom tracker and pass an instance to ``Accelerator(log_with=[...])``.

Example::

    class PrintTracker(GeneralTracker):
        name = "print"
        requires_logging_directory = False

        def store_init_configuration(self, values): print("config", values)
        def log(self, values, step=None, **kwargs): print(step, values)
"""

from __future__ import annotations

from typing import Any, ClassVar


class GeneralTracker:
    """Base class of trackers. Only the main process creates and calls trackers unless
    ``main_process_only`` is False."""

    #: The name used in ``log_with`` and ``get_tracker``.
    name: ClassVar[str] = "tracker"
    #: Whether the tracker needs ``project_dir``/``logging_dir`` to write into.
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir

    def start(self) -> None:
        """Called by ``init_trackers`` before anything is recorded: open files or runs here
        (a tracker made before the Accelerator starts nothing in its constructor)."""

    @property
    def tracker(self) -> Any:
        """The underlying object (a SummaryWriter, a wandb run, ...)."""
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters once, at ``init_trackers``."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string or tensor) at ``step``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close (called by ``end_training``)."""


def scalar(value: Any) -> Any:
    """Numbers stay numbers; one-element tensors and numpy scalars become Python numbers."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
        return item()
    return value
