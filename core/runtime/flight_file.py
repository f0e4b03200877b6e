"""The flight log kept where the launcher can read it after the process is gone.

A process that crashes in native code (gloo's "collective mismatch" aborts it with SIGABRT)
or is killed (SIGKILL) runs no Python on its way out, so it cannot report what it was doing.
Under ``slipstream launch`` each process therefore mirrors its step and its last few
collectives into a small memory-mapped file in the launcher's report folder: plain memory
writes (about a microsecond per collective, a fraction of one per step), which the kernel
keeps when the process dies. The launcher reads them to name each process's last collective
and call site in a crash summary, and the step a replica group was lost at.

Example::

    open_flight_file(rank=0, folder="/tmp/slipstream-launch-x")   # the Accelerator does it
    read_flight_files("/tmp/slipstream-launch-x")   # {pid: {"rank": 0, "step": 12, ...}}
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

#: header: magic, pid, rank, step, wall time of the step, collectives entered so far.
_HEADER = struct.Struct("<4siiqdq")
#: a collective: sequence number, wall times entered and finished (0: still in it),
#: operation, data, call site.
_SLOT = struct.Struct("<qdd24s40s224s")
SLOTS = 4
_MAGIC = b"SSF1"
_SIZE = _HEADER.size + SLOTS * _SLOT.size


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


class FlightFile:
    """This process's mirror of its flight log (see the module docstring)."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        with open(path, "w+b") as handle:
            handle.truncate(_SIZE)
            self._map = mmap.mmap(handle.fileno(), _SIZE)
        self._rank = rank
        self._entered = 0
        self.step(0)

    def step(self, step: int) -> None:
        _HEADER.pack_into(
            self._map, 0, _MAGIC, os.getpid(), self._rank, step, time.time(), self._entered
        )

    def enter(self, seq: int, operation: str, data: str, site: str) -> int:
        """Record a collective entered; returns its slot (for :meth:`finish`)."""
        slot = self._entered % SLOTS
        self._entered += 1
        if len(site) > 224:  # keep the end: the file name and line
            site = "…" + site[-220:]
        _SLOT.pack_into(
            self._map,
            _HEADER.size + slot * _SLOT.size,
            seq,
            time.time(),
            0.0,
            operation.encode()[:24],
            data.encode()[:40],
            site.encode()[:224],
        )
        struct.pack_into("<q", self._map, _HEADER.size - 8, self._entered)
        return slot

    def finish(self, slot: int) -> None:
        struct.pack_into("<d", self._map, _HEADER.size + slot * _SLOT.size + 16, time.time())


_file: FlightFile | None = None


def open_flight_file(rank: int, folder: str | None) -> FlightFile | None:
    """Start mirroring this process's flight log into ``folder`` (the launcher's report
    folder; nothing without one). Idempotent per process."""
    global _file
    if folder is None or (_file is not None and _file.path.parent == Path(folder)):
        return _file
    with contextlib.suppress(OSError):
        _file = FlightFile(Path(folder) / f"flight-{os.getpid()}.bin", rank)
    return _file


def current() -> FlightFile | None:
    """The open flight file of this process, if any."""
    return _file


def read_flight_file(path: Path) -> dict[str, Any] | None:
    """What one process last recorded: ``{"pid", "rank", "step", "step_time",
    "collectives": [{"seq", "op", "data", "site", "started", "finished"}, ...]}`` (oldest
    first), or ``None`` when the file is not one."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _SIZE or raw[:4] != _MAGIC:
        return None
    _, pid, rank, step, step_time, entered = _HEADER.unpack_from(raw, 0)
    records = []
    for index in range(max(0, entered - SLOTS), entered):
        seq, started, finished, op, data, site = _SLOT.unpack_from(
            raw, _HEADER.size + (index % SLOTS) * _SLOT.size
        )
        records.append(
            {
                "seq": seq,
                "op": _text(op),
                "data": _text(data),
                "site": _text(site),
                "started": started,
                "finished": finished or None,
            }
        )
    return {"pid": pid, "rank": rank, "step": step, "step_time": step_time, "collectives": records}


def read_flight_files(folder: str | Path) -> dict[int, dict[str, Any]]:
    """Every process's record in ``folder``, by process id."""
    found = {}
    for path in Path(folder).glob("flight-*.bin"):
        record = read_flight_file(path)
        if record is not None:
            found[int(record["pid"])] = record
    return found
