"""The Accelerator's tracking methods: ``init_trackers``, ``log``, ``get_tracker``."""

from __future__ import annotations

from inspect import signature
from typing import Any

from ..callbacks import CallbackRunner
from ..options.kwargs import ProjectConfiguration
from ..runtime.state import ProcessState
from . import TRACKERS, GeneralTracker


class TrackingMixin:
    """Experiment tracking for the Accelerator; only the main process writes."""

    # Provided by the Accelerator.
    state: ProcessState
    project_configuration: ProjectConfiguration
    callbacks: CallbackRunner
    log_with: list[str | GeneralTracker]
    trackers: list[GeneralTracker]

    def wait_for_everyone(self) -> None:
        raise NotImplementedError

    def wait_for_checkpoint(self) -> str | None:
        raise NotImplementedError

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start the trackers named in ``log_with`` for a run called ``project_name``,
        recording ``config``; ``init_kwargs`` maps tracker names to their own options."""
        init_kwargs = init_kwargs or {}
        self.trackers = []
        for entry in self.log_with:
            if isinstance(entry, GeneralTracker):
                tracker: GeneralTracker | None = entry if self._writes(entry) else None
            else:
                kind = TRACKERS[entry]
                if kind.requires_logging_directory and not self.logging_dir:
                    raise ValueError(
                        f"log_with={entry!r} writes files: give Accelerator(project_dir=...) or "
                        "ProjectConfiguration(logging_dir=...)"
                    )
                options = init_kwargs.get(entry, {})
                tracker = None
                if self._writes(kind) and kind.requires_logging_directory:
                    tracker = kind(project_name, self.logging_dir, **options)
                elif self._writes(kind) and "logging_dir" in signature(kind).parameters:
                    tracker = kind(project_name, logging_dir=self.logging_dir, **options)
                elif self._writes(kind):  # Accelerate's convention: no logging_dir argument
                    tracker = kind(project_name, **options)
            if tracker is not None:
                self.trackers.append(tracker)
        for started in self.trackers:
            started.start()
            if config is not None:
                started.store_init_configuration(config)

    def _writes(self, tracker: Any) -> bool:
        return self.state.is_main_process or not tracker.main_process_only

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Send ``values`` to every tracker (main process) and to callbacks' ``on_log``
        (every process that calls it)."""
        self.callbacks.call("on_log", self, values, step)
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (its underlying object with ``unwrap``)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.state.is_main_process:
            return None  # trackers exist on the main process only
        raise ValueError(
            f"no tracker named {name!r} was started; started: "
            f"{', '.join(t.name for t in self.trackers) or 'none'} (call init_trackers first)"
        )

    def end_training(self) -> None:
        """Commit a pending asynchronous save, fire ``on_train_end``, close the trackers and
        wait for every process."""
        self.wait_for_checkpoint()
        self.callbacks.call("on_train_end", self)
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()
