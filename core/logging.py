"""``slipstream.logging``: ``get_logger``, where Accelerate's scripts import it from. Messages
are logged once, by the main process, or by every process labelled with its rank.

Example::

    from slipstream.logging import get_logger

    logger = get_logger(__name__)
    logger.info("starting")                         # printed by the main process only
    logger.info("my shard", main_process_only=False)  # every process, "[rank 1] my shard"
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from .runtime.env import log_level_from_environment
from .runtime.state import current_state, has_current_state

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg,unused-ignore]
    """Logs on the main process only unless ``main_process_only=False``; prefixes the rank.

    ``in_order=True`` (with ``main_process_only=False``) lets processes log one after
    another.
    """

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        rank = current_state().process_index if has_current_state() else 0
        return f"[rank {rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = current_state() if has_current_state() else None
        message, options = self.process(msg, kwargs)
        if (
            state is None
            or state.num_processes == 1
            or (main_only and state.is_main_process)
            or (not main_only and not in_order)
        ):
            self.logger.log(level, message, *args, **options)
        elif not main_only:
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self.logger.log(level, message, *args, **options)
                state.wait_for_everyone()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning``, but a message (with the same arguments) is logged once only."""
        key = repr((args, sorted(kwargs.items())))
        warned: set[str] = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            kwargs.setdefault("stacklevel", 3)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger whose messages appear once, from the main process, with the rank prefixed.

    Without ``log_level``, ``SLIPSTREAM_LOG_LEVEL`` (or Accelerate's ``ACCELERATE_LOG_LEVEL``)
    sets it when present.
    """
    if log_level is None:
        log_level = log_level_from_environment()
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper() if isinstance(log_level, str) else log_level)
        logger.root.setLevel(logger.level)
    return MultiProcessAdapter(logger, {})
