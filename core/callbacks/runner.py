"""CallbackRunner: calls hooks on every callback that defines them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _defining(callbacks: list[Any], hook: str) -> list[Any]:
    """The bound ``hook`` methods of ``callbacks``, leaving out the :class:`Callback` base
    class's empty ones (a subclass defines only the hooks it needs)."""
    from .base import Callback

    empty = getattr(Callback, hook, None)
    methods = []
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None and getattr(method, "__func__", None) is not empty:
            methods.append(method)
    return methods


class CallbackError(RuntimeError):
    """A callback raised; the message names the callback and the hook."""


class CallbackRunner:
    """Holds the callbacks of one Accelerator and fires hooks on them, in order."""

    def __init__(self, callbacks: Sequence[Any] = ()) -> None:
        self.callbacks = list(callbacks)
        # hook -> the callbacks defining it, looked up once: hooks fire several times a step.
        self._defining: dict[str, list[Any]] = {}
        self._seen = len(self.callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """``callback.hook(*args, **kwargs)`` on each callback defining ``hook``."""
        if len(self.callbacks) != self._seen:  # callbacks were added or removed
            self._defining.clear()
            self._seen = len(self.callbacks)
        methods = self._defining.get(hook)
        if methods is None:
            methods = self._defining[hook] = _defining(self.callbacks, hook)
        for method in methods:  # (a try block costs nothing until something raises)
            try:
                method(*args, **kwargs)
            except CallbackError:
                raise
            except Exception as error:
                owner = getattr(method, "__self__", method)
                raise CallbackError(
                    f"callback {type(owner).__name__} failed in {hook}: "
                    f"{type(error).__name__}: {error}"
                ) from error

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
