"""What a replica group says about itself, once each, through the launcher
(:mod:`slipstream.runtime.events`): that it rejoined (at which step, from which peer, how
long the copy took), that it stopped because the job had finished or goes on alone, and at
exit a summary the launcher prints for every group. Also keeps torchft's checkpoint server
from printing an HTTP access-log line per state transfer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from ..runtime.env import report_dir
from ..runtime.events import announce


def summary_file(folder: str | Path, replica_id: str, life: int) -> Path:
    """Where a group's first process leaves its summary for the launcher."""
    return Path(folder) / f"ft-summary-{replica_id}-life{life}.json"


def leave_summary(
    replica_id: str,
    life: int,
    step: int,
    committed: int,
    discarded: int,
    recoveries: int,
    stopped: bool = False,
    unit: str = "step",
) -> None:
    """At exit: this life of the group's counts, for the launcher's last lines (said here
    when there is no launcher); ``stopped``: it stopped because the job had finished."""
    folder = report_dir()
    if folder is None:
        announce(
            f"replica group {replica_id}: ended at step {step}; {committed} {unit}s committed, "
            f"{discarded} discarded, {recoveries} recoveries from a peer"
        )
        return
    record = {
        "replica_id": replica_id,
        "life": life,
        "step": step,
        "committed": committed,
        "discarded": discarded,
        "recoveries": recoveries,
        "stopped": stopped,
        "unit": unit,
    }
    with contextlib.suppress(OSError):
        summary_file(folder, replica_id, life).write_text(json.dumps(record))


def rejoined(replica_id: str, life: int, step: int, source: str | None, seconds: float) -> None:
    what = "rejoined" if life > 0 else "joined late"
    peer = f"from {source} " if source else ""
    announce(
        f"replica group {replica_id} {what} at step {step}, state copied {peer}in {seconds:.1f} s"
    )


def quiet_checkpoint_server(manager: Any) -> None:
    """torchft serves a group's state to a rejoining peer with Python's HTTP server, which
    prints an access-log line per request (``"GET /checkpoint/581/full HTTP/1.1" 200 -``) to
    stderr: drop those (errors still print)."""
    transport = getattr(manager, "_checkpoint_transport", None)
    server = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_request = _no_access_log


def _no_access_log(self: Any, code: Any = "-", size: Any = "-") -> None:
    return None


def quiet_torchft() -> None:
    """Drop torchft's notes that say nothing on CPU: it cannot reset NCCL's flight recorder
    (logged at every new quorum) and torch's warning about reading a recovered state from a
    read-only buffer. Only those exact messages."""
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorderNote) for f in manager_log.filters):
        manager_log.addFilter(_NoFlightRecorderNote())
    warnings.filterwarnings(
        "ignore",
        message="The given buffer is not writable",
        category=UserWarning,
        module=r"torch\.distributed\._serialization",
    )


class _NoFlightRecorderNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()
