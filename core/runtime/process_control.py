"""ProcessControl: where this process is, and running code on some processes only.

Mixed into the Accelerator; it needs only ``self.state`` (a ProcessState).

Example::

    @accelerator.on_main_process
    def log(message): print(message)

    with accelerator.main_process_first():
        dataset = load_or_download()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from .splitting import split_between_processes as _split
from .state import ProcessState

F = TypeVar("F", bound=Callable[..., Any])


class ProcessControl:
    """Who-am-I properties, barriers and per-process decorators over ``self.state``."""

    state: ProcessState
    _trigger: bool = False

    def set_trigger(self) -> None:
        """Raise a flag on this process (e.g. early stopping); see :meth:`check_trigger`."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger` since the last
        check (then the flag is cleared). Must be called on every process.

        Example::

            if loss.isnan(): accelerator.set_trigger()
            if accelerator.check_trigger(): break   # every rank leaves the loop together
        """
        from .collectives import reduce

        flag = torch.tensor([1 if self._trigger else 0], device=self.state.device)
        raised = int(reduce(flag, "sum", state=self.state).item()) > 0
        if raised:
            self._trigger = False
        return raised

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this line."""
        self.state.wait_for_everyone()

    # -- process control ----------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on all others (e.g. downloads)."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like :meth:`main_process_first`, once per machine."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (others get ``None``)."""
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on each machine's main process only."""
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        """Decorator: run ``function`` on the last process only."""
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only.

        Use as ``@accelerator.on_process(process_index=1)``.
        """
        if process_index is None:
            raise TypeError("on_process needs process_index=")
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run ``function`` on local process ``local_process_index`` of every
        machine only. Use as ``@accelerator.on_local_process(local_process_index=1)``."""
        if local_process_index is None:
            raise TypeError("on_local_process needs local_process_index=")
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_if(function: F, condition: Callable[[], bool]) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper  # type: ignore[return-value]

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's share of ``inputs`` (see :mod:`slipstream.runtime.splitting`)."""
        with _split(inputs, self.process_index, self.num_processes, apply_padding) as part:
            yield part
