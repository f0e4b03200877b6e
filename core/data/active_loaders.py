"""ActiveLoaders: which prepared dataloaders are being iterated right now.

Kept apart from the data package so the Accelerator can hold one without importing
``torch.utils.data`` (import time matters: see benchmarks/startup.py).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Generic, Protocol, TypeVar


class _Loader(Protocol):
    @property
    def end_of_dataloader(self) -> bool: ...


#: The loaders tracked: slipstream's PreparedDataLoader (``ActiveLoaders`` alone means any).
PreparedDataLoader = TypeVar("PreparedDataLoader", bound=_Loader)


class _WeakHook:
    """An attribute holding a bound method weakly (any other callable as it is)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        held = instance.__dict__.get(self.slot)
        return held() if isinstance(held, weakref.WeakMethod) else held

    def __set__(self, instance: Any, hook: Any) -> None:
        held = weakref.WeakMethod(hook) if inspect.ismethod(hook) else hook
        instance.__dict__[self.slot] = held


_HOOKS = ("on_pass_end", "before_batch", "gradient_state")


class ActiveLoaders(Generic[PreparedDataLoader]):
    """Which prepared loaders are being iterated right now (innermost last).

    The Accelerator owns one; ``gather_for_metrics`` and gradient synchronisation read the
    innermost loader's ``end_of_dataloader`` and tail information.
    """

    # The hooks are the owner's (the Accelerator's) methods, held weakly: the owner holds
    # this object, and a strong reference back would keep a dropped Accelerator (and its
    # models) alive until the garbage collector runs. Pickled as the methods themselves.
    on_pass_end = _WeakHook()
    before_batch = _WeakHook()
    gradient_state = _WeakHook()

    def __init__(self) -> None:
        self.stack: list[PreparedDataLoader] = []
        #: Called with a loader when it finished a whole pass (the Accelerator's callbacks).
        self.on_pass_end = None  # Callable[[PreparedDataLoader], None] | None
        #: Called before a loader fetches each batch: the step boundary where a preempted
        #: job saves and stops (``save_on_preemption``).
        self.before_batch = None  # Callable[[], None] | None
        #: Returns the owner's GradientState (a prepared loader's ``gradient_state``).
        self.gradient_state = None  # Callable[[], GradientState] | None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **{f"_{name}": getattr(self, name) for name in _HOOKS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _HOOKS:
            setattr(self, name, state[f"_{name}"])

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
