"""tqdm's options for where its bar goes: in a terminal as tqdm draws it; in a log file or a
pipe (not a terminal: a job's output captured by a scheduler, ``> train.log``) each refresh
is a line of its own, at most every :data:`LOG_REFRESH_SECONDS`, instead of a stream of
carriage returns that a log shows as one endless line.

Example::

    from tqdm.auto import tqdm
    bar = tqdm(loader, **bar_options({"desc": "epoch 0"}))
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

#: Seconds between two refreshes of a bar written to a log (tqdm's own default is 0.1 s).
LOG_REFRESH_SECONDS = 30.0


class LineStream:
    """Where a bar writes in a log: tqdm's ``"\\r" + bar`` refreshes become lines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        for part in text.split("\r"):
            line = part.strip()
            if line:
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def bar_options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` for tqdm, adjusted when its stream is not a terminal (see the module
    docstring); the caller's own ``mininterval`` wins. Notebooks are left to tqdm."""
    options = dict(kwargs)
    stream = options.get("file") or sys.stderr
    interactive = getattr(stream, "isatty", lambda: False)()
    if interactive or "ipykernel" in sys.modules or isinstance(stream, LineStream):
        return options
    options.setdefault("mininterval", LOG_REFRESH_SECONDS)
    options["file"] = LineStream(stream)
    return options
