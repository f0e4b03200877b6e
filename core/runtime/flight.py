"""What this process is doing, recorded cheaply enough to leave on: the last optimizer step
(and when it happened) and the last collectives slipstream entered, with their sequence
numbers, data and the line of the script that called them.

A hang report (:mod:`slipstream.diagnostics.hang`) reads this when the job stops making
progress. torch's own Flight Recorder (switched on by :func:`slipstream.runtime.env.
enable_flight_recorder` before the process group forms) records the collectives torch runs
for DDP, FSDP2 and direct ``torch.distributed`` calls; this log adds slipstream's names
(``gather``, ``wait_for_everyone``...) and is all there is where torch has no recorder.

Recording costs a few attribute writes per optimizer step (the watchdog, waking every few
seconds, notices the count of marked steps move and times it itself) and about a microsecond per
slipstream collective; backward is timed only while a ``StragglerMonitor`` asks for it.

Example::

    record = COLLECTIVES.enter("gather", data, group=None)
    ...                                        # the collective
    COLLECTIVES.finish(record)
    PROGRESS.mark_step(12)                     # the optimizer stepped
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import flight_file

#: How many of slipstream's collectives each process remembers.
LOG_LENGTH = 64
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Frames skipped when looking for the script's call: slipstream's and the context-manager
#: machinery its ``with`` blocks go through.
_LIBRARY_FILES = (_PACKAGE_DIR, os.path.splitext(contextlib.__file__)[0])


@dataclass
class Progress:
    """When this process last made progress (an optimizer step, a finished collective).

    ``armed`` turns true at the first optimizer step: before it (loading a model, compiling)
    only a collective that waits too long counts as a hang, not a slow start.
    """

    step: int = 0
    last: float = field(default_factory=time.monotonic)
    armed: bool = False
    #: Set while the script is ending (the exit barrier): a process there is done, not stuck.
    finishing: bool = False
    #: Seconds spent in ``accelerator.backward`` so far, and when the last one ended
    #: (``time.perf_counter``): where data-parallel processes wait for each other, which a
    #: straggler monitor leaves out of a process's own time. Kept only while
    #: ``time_backward`` is set (by a straggler monitor).
    backward_seconds: float = 0.0
    backward_end: float = 0.0
    time_backward: bool = False
    #: Optimizer steps marked so far (skipped ones and later runs' included: the step
    #: number may repeat, this count does not), the count the watchdog saw last and when
    #: it saw it move (``time.monotonic``).
    _marks: int = 0
    _seen: tuple[int, float] = (0, 0.0)

    def mark_step(self, step: int) -> None:
        """An optimizer step completed (called by the step coordinator): no clock is read
        here; :meth:`last_progress` times the step count's moves."""
        self.step = step
        self._marks += 1
        self.armed = True
        mirror = flight_file._file
        if mirror is not None:  # (read by the launcher if this process dies)
            mirror.step(step)

    def last_progress(self) -> float:
        """When this process last made progress (``time.monotonic``): the last collective
        or checkpoint, or the first look after an optimizer step was marked (called by the
        watchdog every few seconds, so a step is timed to within one of its periods)."""
        seen, at = self._seen
        if self._marks != seen:
            at = time.monotonic()
            self._seen = (self._marks, at)
        return max(self.last, at)

    def mark(self) -> None:
        """Something completed that shows the job moves (a collective, a checkpoint)."""
        self.last = time.monotonic()


@dataclass(slots=True)
class CollectiveRecord:
    """One collective slipstream entered."""

    seq: int
    operation: str
    #: ``None``: all processes; else the global ranks of the group.
    group: tuple[int, ...] | None
    data: str
    #: ``file:line`` of the script's call (the first frame outside slipstream).
    site: str
    started: float
    finished: float | None = None
    #: Where the flight file (:mod:`~slipstream.runtime.flight_file`) holds it, if kept.
    slot: int = -1

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "op": self.operation,
            "group": list(self.group) if self.group is not None else None,
            "data": self.data,
            "site": self.site,
            "age": round(now - self.started, 3),
            "pending": self.finished is None,
        }


def describe_data(data: Any) -> str:
    """A short description of a collective's argument: ``float32[3, 4]``, ``dict(2)``."""
    shape = getattr(data, "shape", None)
    if shape is not None and hasattr(data, "dtype"):
        return f"{str(data.dtype).removeprefix('torch.')}{list(shape)}"
    if isinstance(data, (list, tuple, dict)):
        return f"{type(data).__name__}({len(data)})"
    return type(data).__name__ if data is not None else "-"


def caller_site(depth: int = 2) -> str:
    """``file:line`` of the innermost frame outside slipstream (the script's call)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class CollectiveLog:
    """The last :data:`LOG_LENGTH` collectives, numbered per group as torch numbers them."""

    def __init__(self, length: int = LOG_LENGTH) -> None:
        self.records: deque[CollectiveRecord] = deque(maxlen=length)
        self._counters: dict[tuple[int, ...] | None, int] = {}

    def enter(self, operation: str, data: Any, group: tuple[int, ...] | None) -> CollectiveRecord:
        seq = self._counters.get(group, 0) + 1
        self._counters[group] = seq
        record = CollectiveRecord(
            seq, operation, group, describe_data(data), caller_site(3), time.monotonic()
        )
        self.records.append(record)
        mirror = flight_file._file
        if mirror is not None:
            record.slot = mirror.enter(seq, operation, record.data, record.site)
        return record

    def finish(self, record: CollectiveRecord) -> None:
        record.finished = time.monotonic()
        PROGRESS.last = record.finished
        mirror = flight_file._file
        if mirror is not None and record.slot >= 0:
            mirror.finish(record.slot)

    def pending(self) -> CollectiveRecord | None:
        """The collective this process waits in (the last one, if unfinished)."""
        last = self.records[-1] if self.records else None
        return last if last is not None and last.finished is None else None

    def to_list(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [record.to_dict(now) for record in list(self.records)]


PROGRESS = Progress()
COLLECTIVES = CollectiveLog()

#: Called (by :func:`report_timeout`) when a collective timed out, before the error is
#: raised: the hang watchdog installs itself here to report the hang for the whole job.
_timeout_handlers: list[Callable[[str], None]] = []


def on_timeout(handler: Callable[[str], None] | None) -> None:
    """Install ``handler(reason)`` as what a timed-out collective calls (``None``: remove)."""
    _timeout_handlers.clear()
    if handler is not None:
        _timeout_handlers.append(handler)


def report_timeout(reason: str) -> None:
    """A collective timed out: let the installed handler report the hang (it may end the
    process); returns when there is none."""
    for handler in list(_timeout_handlers):
        handler(reason)


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a collective or store timeout."""
    seen: BaseException | None = error
    while seen is not None:
        text = str(seen).lower()
        if "timed out" in text or "timeout" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
