"""How a process of a job ends: after a clean finish it waits (bounded) for the others at
exit before tearing its process group down; after an error it leaves at once.

Example::

    watch_for_failure()
    atexit.register(destroy_group_at_exit)
"""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .flight import PROGRESS, is_timeout, report_timeout

_failed = False
#: How long a cleanly finishing process waits at exit for the others to finish too.
EXIT_BARRIER_TIMEOUT = timedelta(seconds=60)


def note_failure() -> None:
    """Record that this process is ending with an error (no exit barrier then)."""
    global _failed
    _failed = True


def watch_for_failure() -> None:
    """Note an uncaught exception as a failure (and let the hang watchdog report a
    collective that timed out first)."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        note_failure()
        if is_timeout(value):  # a collective timed out: let the hang watchdog report first
            report_timeout(f"{kind.__name__}: {str(value)[:120]}")
        previous(kind, value, tb)

    sys.excepthook = excepthook


def destroy_group_at_exit() -> None:
    """Registered at exit by a process that formed a group: wait for the others, then
    tear the group down."""
    # Without this gloo can abort at interpreter shutdown ("terminate called without an
    # active exception") and turn a successful run into a non-zero exit code. A process
    # that finished cleanly first waits (bounded) for the others, so no process tears down
    # connections a peer is still using; after a failure it leaves at once.
    PROGRESS.finishing = True  # waiting for the others here is not a hang of this process
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not _failed and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=EXIT_BARRIER_TIMEOUT)
    dist.destroy_process_group()
