"""ActiveLoaders: which prepared dataloaders are being iterated right now.

Kept apart from the data package so the Accelerator can hold one without importing
``torch.utils.data`` (import time matters: see benchmarks/startup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _Loader(Protocol):
    @property
    def end_of_dataloader(self) -> bool: ...


#: The loaders tracked: slipstream's PreparedDataLoader (``ActiveLoaders`` alone means any).
PreparedDataLoader = TypeVar("PreparedDataLoader", bound=_Loader)


class ActiveLoaders(Generic[PreparedDataLoader]):
    """Which prepared loaders are being iterated right now (innermost last).

    The Accelerator owns one; ``gather_for_metrics`` and gradient synchronisation read the
    innermost loader's ``end_of_dataloader`` and tail information.
    """

    def __init__(self) -> None:
        self.stack: list[PreparedDataLoader] = []
        #: Called with a loader when it finished a whole pass (the Accelerator's callbacks).
        self.on_pass_end: Callable[[PreparedDataLoader], None] | None = None
        #: Called before a loader fetches each batch: the step boundary where a preempted
        #: job saves and stops (``save_on_preemption``).
        self.before_batch: Callable[[], None] | None = None

    @property
    def innermost(self) -> PreparedDataLoader | None:
        return self.stack[-1] if self.stack else None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.innermost
        return loader is not None and loader.end_of_dataloader

    def push(self, loader: PreparedDataLoader) -> None:
        self.stack.append(loader)

    def pop(self, loader: PreparedDataLoader) -> None:
        if loader in self.stack:
            self.stack.remove(loader)
