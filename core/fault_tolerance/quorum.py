"""torchft's quorum asked for on a thread of its own, so a step's quorum overlaps the
previous step's optimizer step (see :mod:`slipstream.fault_tolerance.controller`)."""

from __future__ import annotations

import threading
from typing import Any


class QuorumThread:
    """Runs ``manager.start_quorum()`` (torchft's synchronous quorum: a group that is behind
    heals in it) on a thread of its own, one at a time: :meth:`ask` starts one, :meth:`wait`
    waits for it and raises its error. A daemon, so a quorum still out does not hold the
    interpreter at exit."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._asked = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slipstream-ft-quorum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            try:
                self._manager.start_quorum()
            except BaseException as error:  # handed to the training thread by wait()
                self._error = error
            self._done.set()

    def ask(self) -> None:
        self._done.clear()
        self._error = None
        self._asked.set()

    def wait(self, timeout: float | None = None, *, quiet: bool = False) -> None:
        self._done.wait(timeout)
        error, self._error = self._error, None
        if error is not None and not quiet:
            raise error
