"""``slipstream.logging``: where Accelerate's scripts import ``get_logger`` from.

Example::

    from slipstream.logging import get_logger

    logger = get_logger(__name__)
    logger.info("printed once, by the main process")
"""

from __future__ import annotations

from .logger import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
