"""The launcher's side of hang reports and events: print each report the workers leave in
its folder, once, as soon as it appears (also between elastic restarts), and each event line
(:mod:`slipstream.runtime.events`: a replica group lost or rejoined, a resize) as
``slipstream launch: <line>``.

The workers write ``hang-report-<attempt>.txt`` into the folder named by
``SLIPSTREAM_REPORT_DIR`` (see :mod:`slipstream.diagnostics.hang`), and each its own account
(``dump-rank<r>.json``) beside it. When the report itself never came (the process that
writes it could not run), the launcher builds one from the accounts that are there.

Example::

    with HangReports(folder) as reports:
        run(torchrun_args)
    hung = reports.collect()
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from ..runtime.events import EventReader

#: How often the folder is looked at while the job runs.
POLL_SECONDS = 0.5


class HangReports:
    """Watches the launcher's report folder in a daemon thread."""

    def __init__(self, folder: str | Path, stream: Any = None) -> None:
        self.folder = Path(folder)
        self.stream = stream
        self.printed: set[str] = set()
        self.events = EventReader(self.folder)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="slipstream-hang-reports")
        self._thread.daemon = True

    def __enter__(self) -> HangReports:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_SECONDS)
        self._print_new_events()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._print_new()

    def _print_new_events(self) -> None:
        with self._lock:
            stream = self.stream or sys.stderr
            for event in self.events.new():
                print(f"slipstream launch: {event.get('text')}", file=stream, flush=True)

    def _print_new(self) -> None:
        self._print_new_events()
        with self._lock:
            for path in sorted(self.folder.glob("hang-report-*.txt")):
                if path.name in self.printed:
                    continue
                with contextlib.suppress(OSError):
                    text = path.read_text()
                    print(text, file=self.stream or sys.stderr, flush=True)
                    self.printed.add(path.name)

    def collect(self) -> bool:
        """Print what has not been printed yet; whether the job reported a hang. Without a
        report but with accounts, a report is built from the accounts."""
        self._print_new()
        if self.printed:
            return True
        dumps: dict[int, dict[str, Any]] = {}
        for path in self.folder.glob("dump-rank*.json"):
            with contextlib.suppress(OSError, ValueError):
                dump = json.loads(path.read_text())
                dumps[int(dump["rank"])] = dump
        if not dumps:
            return False
        from ..diagnostics.hang import HANG_EXIT_CODE
        from ..diagnostics.hang_report import build_report

        world = max(int(d.get("world_size", 1)) for d in dumps.values())
        declared = {"reason": "the job stopped making progress (no process wrote the report)"}
        text, _ = build_report(dumps, world, declared, exit_code=HANG_EXIT_CODE)
        print(text, file=self.stream or sys.stderr, flush=True)
        self.printed.add("built-by-launcher")
        return True
