"""Errors of collectives and process groups, and :func:`guarded`, which turns torch's
low-level timeout and lost-peer errors into them (and records the collective for hang
reports). Both the process state and the collective checks raise these, so they live below
both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .flight import COLLECTIVES, report_timeout

_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "failed to recv, got 0 bytes",
)


class DistributedOperationException(Exception):
    """A collective cannot run with what the processes passed (Accelerate's name: scripts
    catch it around collectives in debug mode)."""


class CollectiveMismatchError(DistributedOperationException, RuntimeError):
    """Ranks called different collectives, or the same one with incompatible data."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than the process-group timeout for the other ranks."""


class PeerProcessFailedError(RuntimeError):
    """Another process of the job went away while this one waited for it."""


@contextlib.contextmanager
def guarded(
    operation: str, rank: int, data: Any = None, group: tuple[int, ...] | None = None
) -> Iterator[None]:
    """Turn torch's low-level timeout / lost-peer errors into ones that say what to do.

    The collective is recorded in :data:`slipstream.runtime.flight.COLLECTIVES` (``data``
    and ``group``, the global ranks taking part, describe it); a timeout first lets the
    hang watchdog report the job's state (see :mod:`slipstream.diagnostics.hang`)."""
    record = COLLECTIVES.enter(operation, data, group)
    try:
        yield
        COLLECTIVES.finish(record)
    except RuntimeError as error:
        text = str(error)
        # "Connect timeout": gloo connects at the first collective (see connect_gloo_lazily).
        if "timed out" in text.lower() or "timeout" in text.lower():
            report_timeout(f"collective '{operation}' on process {rank} timed out")
            raise CollectiveTimeoutError(
                f"collective '{operation}' on process {rank} timed out waiting for the other "
                "processes. Usually one process skipped this call or called another collective; "
                "rerun with `slipstream launch --debug` (or SLIPSTREAM_DEBUG=1) to see which "
                f"process passed what. ({text.strip()[:200]})"
            ) from error
        if any(marker in text for marker in _PEER_GONE):
            raise PeerProcessFailedError(
                f"collective '{operation}' on process {rank} lost its peers: another process "
                f"stopped (look for its traceback). ({text.strip()[:200]})"
            ) from error
        raise
