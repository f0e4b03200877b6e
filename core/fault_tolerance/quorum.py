"""torchft's per-step protocol run on a thread of its own: the commit vote of a step and
then the quorum of the next one, so that the vote overlaps what the training thread does
until the optimizer steps, and the quorum the optimizer step and whatever the script does
until the next batch (see :mod:`slipstream.fault_tolerance.controller`)."""

from __future__ import annotations

import threading
from typing import Any


class QuorumThread:
    """Runs ``manager.start_quorum()`` (torchft's synchronous quorum: a group that is behind
    heals in it) on a thread of its own, one at a time, optionally after the open step's
    vote (``manager.should_commit()``, then the state is locked against peers' reads until
    the next step opens): :meth:`ask` starts them, :meth:`vote` waits for the vote,
    :meth:`wait` for the quorum and raises its error. A daemon, so a quorum still out does
    not hold the interpreter at exit."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._asked = threading.Event()
        self._done = threading.Event()
        self._voted = threading.Event()
        self._vote_first = False
        self._commit: bool | None = None
        self._vote_error: BaseException | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="slipstream-ft-quorum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._vote_first:
                try:
                    self._commit = bool(self._manager.should_commit())
                    self._manager.disallow_state_dict_read()
                except BaseException as error:  # handed to the training thread by vote()
                    self._vote_error = error
                    self._voted.set()
                    self._done.set()
                    continue
                self._voted.set()
            try:
                self._manager.start_quorum()
            except BaseException as error:  # handed to the training thread by wait()
                self._error = error
            self._done.set()

    def ask(self, *, vote_first: bool = False) -> None:
        """Start the next quorum; with ``vote_first``, the open step's vote before it."""
        self._done.clear()
        self._voted.clear()
        self._error = self._vote_error = None
        self._commit = None
        self._vote_first = vote_first
        self._asked.set()

    def vote(self) -> bool:
        """The vote asked for with :meth:`ask` (``vote_first``); raises its error."""
        self._voted.wait()
        if self._vote_error is not None:
            error, self._vote_error = self._vote_error, None
            raise error
        return bool(self._commit)

    def wait(self, timeout: float | None = None, *, quiet: bool = False) -> None:
        self._done.wait(timeout)
        error, self._error = self._error, None
        if error is not None and not quiet:
            raise error
