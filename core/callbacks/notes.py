"""How the monitors and the guard say something: one line, from the main process, through
Python's logging (logger ``slipstream.monitors``) when the script configured logging, else
``slipstream: ...`` on stdout, with the script's own messages.

Example::

    say(accelerator, "straggler: process 2 (node3) ...", logging.WARNING)
"""

from __future__ import annotations

import logging
from typing import Any

LOGGER = logging.getLogger("slipstream.monitors")


def say(accelerator: Any, text: str, level: int = logging.INFO) -> None:
    """Say ``text`` once (see the module docstring)."""
    if not accelerator.is_main_process:
        return
    if LOGGER.hasHandlers():
        LOGGER.log(level, text)
    else:
        print(f"slipstream: {text}", flush=True)
