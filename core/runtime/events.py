"""Abnormal events of a long run — a replica group lost or rejoined, a job resized — each
one plain line, once, in one place: the launcher's output.

A worker (or a replica group's agent) started by ``slipstream launch`` appends the line to
the launcher's report folder; the launcher prints it as soon as it appears, as
``slipstream launch: <line>``. Without the launcher the line goes to this process's stderr
as ``slipstream: <line>``.

Example::

    announce("replica group replica_1 rejoined at step 583, state copied from replica_0 in 1.9 s")
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .env import report_dir

#: The file, in the launcher's report folder, that the lines are appended to.
EVENTS_FILE = "events.jsonl"


def announce(text: str, folder: str | None = None) -> None:
    """Say ``text`` through the launcher (see the module docstring)."""
    folder = report_dir() if folder is None else folder
    if folder:
        line = (json.dumps({"time": time.time(), "text": text}) + "\n").encode()
        with contextlib.suppress(OSError):
            # One write of a short line with O_APPEND: lines from many processes never mix.
            handle = os.open(
                os.path.join(folder, EVENTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            try:
                os.write(handle, line)
            finally:
                os.close(handle)
            return
    print(f"slipstream: {text}", file=sys.stderr, flush=True)


class EventReader:
    """The launcher's side: the lines appended since the last :meth:`new`."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / EVENTS_FILE
        self._offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(complete)
        events = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events
