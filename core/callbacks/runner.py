"""CallbackRunner: calls hooks on every callback that defines them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CallbackError(RuntimeError):
    """A callback raised; the message names the callback and the hook."""


class CallbackRunner:
    """Holds the callbacks of one Accelerator and fires hooks on them, in order."""

    def __init__(self, callbacks: Sequence[Any] = ()) -> None:
        self.callbacks = list(callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """``callback.hook(*args, **kwargs)`` on each callback defining ``hook``."""
        for callback in self.callbacks:
            self.call_one(callback, hook, *args, **kwargs)

    @staticmethod
    def call_one(callback: Any, hook: str, *args: Any, **kwargs: Any) -> None:
        """One callback's hook; an error names the callback and the hook."""
        method = getattr(callback, hook, None)
        if method is None:
            return
        try:
            method(*args, **kwargs)
        except CallbackError:
            raise
        except Exception as error:
            raise CallbackError(
                f"callback {type(callback).__name__} failed in {hook}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def state_keys(self) -> list[str]:
        """A stable key per callback for checkpoints: class name plus position."""
        return [f"{type(c).__name__}_{i}" for i, c in enumerate(self.callbacks)]
