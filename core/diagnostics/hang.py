"""Hang reports: when the job stops making progress, every process says what it is doing and
one report names the processes that are behind or elsewhere, then the job ends with
:data:`HANG_EXIT_CODE`.

A daemon thread in each process (the watchdog) looks every few seconds at this process's
progress (:mod:`slipstream.runtime.flight`): no optimizer step or finished collective for
``hang_timeout`` seconds (counted from the first optimizer step), or a slipstream collective
waiting that long, and it declares a hang in the job's key-value store (the one
torch.distributed's rendezvous uses; a connection of its own, so nothing here goes through
the stuck process group). A collective that times out in torch declares one too. Every
process's watchdog sees the declaration at its next look and writes its account: its main
thread's stack, its last collectives (torch's Flight Recorder, and slipstream's log), its
step. Rank 0 collects the accounts, builds the report (:mod:`.hang_report`), writes it to
the project folder (``{project_dir}/diagnostics/``, else ``./slipstream-diagnostics/``)
and, under ``slipstream launch``, to the launcher, which prints it; without a launcher rank
0 prints it. Then every process exits with :data:`HANG_EXIT_CODE`.

The cost while nothing hangs: one look at two numbers every few seconds and a store lookup
(one small request) in the same rhythm, in a thread that sleeps in between.

Example (the Accelerator starts it; ``hang_timeout=0`` switches it off)::

    accelerator = Accelerator(hang_timeout=600)     # seconds without progress
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..runtime.env import (
    debug_watchdog,
    fault_tolerance_environment,
    hang_timeout_from_environment,
    report_dir,
)
from ..runtime.flight import COLLECTIVES, PROGRESS, on_timeout
from ..runtime.flight_file import open_flight_file
from ..runtime.state import ProcessState

# The report's parts (flight_recorder, hang_report, stacks) are imported when the watchdog
# starts, not with slipstream: an Accelerator that never watches never loads them.

#: The exit code of a job ended by a hang report (distinct from errors, 1, and preemption, 75).
HANG_EXIT_CODE = 86
#: How long rank 0 waits for every process's account before reporting without the missing.
COLLECT_SECONDS = 10.0
#: Looks at the progress at most this far apart (less for short timeouts).
MAX_PERIOD_SECONDS = 5.0
_DECLARED, _REPORT, _ACKS = "declared", "report", "acks"


def report_file_name(restart_count: int) -> str:
    """The report's name in the launcher's folder (one per elastic restart attempt)."""
    return f"hang-report-{restart_count}.txt"


def resolve_hang_timeout(
    requested: float | timedelta | None,
    launch: dict[str, Any],
    group_timeout: timedelta,
    processes: int = 2,
) -> float | None:
    """Seconds without progress that make a hang (``None``: never).

    The argument, else the launcher's ``hang_timeout``, else ``SLIPSTREAM_HANG_TIMEOUT``,
    else (several processes) a little under the process group's timeout, so the report comes
    before torch's own timeout errors. 0 switches hang reports off. A single process is
    watched only when asked: an interactive session may rightly sit idle.
    """
    for value in (requested, launch.get("hang_timeout"), hang_timeout_from_environment()):
        if value is None:
            continue
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
        if seconds < 0:
            raise ValueError(f"hang_timeout must be >= 0 seconds (0: off), got {seconds}")
        return seconds or None
    if processes == 1:
        return None
    total = group_timeout.total_seconds()
    return max(1.0, total - min(60.0, total * 0.1))


def _job_store(state: ProcessState) -> Any:
    """A connection of this thread's own to the job's store, under a prefix per restart
    attempt; ``None`` for a single process or a store that cannot be shared."""
    import torch.distributed as dist

    if state.num_processes == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    prefix = f"slipstream/hang/attempt_{state.launch.restart_count}/"
    clone = getattr(store, "clone", None)
    if clone is not None:
        connection = clone()
    else:  # older torch: a client of the same server
        connection = dist.TCPStore(
            store.host, store.port, is_master=False, timeout=timedelta(seconds=60)
        )
    return dist.PrefixStore(prefix, connection)


class HangWatchdog:
    """The per-process watchdog (see the module docstring). One per process: see
    :func:`start_hang_watchdog`."""

    def __init__(
        self,
        state: ProcessState,
        timeout: float,
        project_dir: Callable[[], str | None] = lambda: None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.state = state
        self.timeout = timeout
        self.project_dir = project_dir
        self._exit = exit
        #: The job's store, connected by the thread itself: a peer that already left (its
        #: process hosted the store) must not hold up this process's main thread.
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._stop = threading.Event()
        self._declared = threading.Event()
        #: Set to wake the thread early: on a declaration here, or to stop it.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: The report this process wrote or received (for tests and the launcher).
        self.report: str | None = None

    @property
    def period(self) -> float:
        return min(MAX_PERIOD_SECONDS, max(0.1, self.timeout / 10))

    def start(self) -> None:
        # Imported now, on the main thread: a hung process must not need the import lock.
        from . import flight_recorder, hang_report, stacks  # noqa: F401

        self._thread = threading.Thread(target=self._run, name="slipstream-hang-watchdog")
        self._thread.daemon = True
        self._thread.start()
        on_timeout(self.collective_timed_out)

    def stop(self, wait: float = 0.0) -> None:
        """Stop the thread (and wait up to ``wait`` seconds for it to end)."""
        self._stop.set()
        self._wake.set()
        on_timeout(None)
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait)

    # -- noticing -------------------------------------------------------------------------
    def stalled(self) -> str | None:
        """Why this process counts as stuck now, or ``None``."""
        if PROGRESS.finishing:
            return None
        now = time.monotonic()
        pending = COLLECTIVES.pending()
        if pending is not None and now - pending.started > self.timeout:
            return (
                f"{pending.operation} (called at {pending.site}) waited "
                f"{now - pending.started:.0f} s for the other processes"
            )
        last = PROGRESS.last_progress()
        if PROGRESS.armed and now - last > self.timeout:
            return f"no progress for {now - last:.0f} s after step {PROGRESS.step}"
        return None

    def declare(self, reason: str) -> None:
        """Announce a hang to every process (the first announcement wins)."""
        payload = json.dumps({"rank": self.state.process_index, "reason": reason})
        with self._store_lock:
            if self._store is None:
                self._local_declaration = payload
            else:
                self._store.compare_set(_DECLARED, "", payload)
        self._declared.set()
        self._wake.set()

    def collective_timed_out(self, reason: str) -> None:
        """Called in the main thread when torch timed out a collective: report, then wait for
        the watchdog to end the process (the error is raised if it does not)."""
        if self._thread is None or not self._thread.is_alive() or self._declared.is_set():
            return
        self.declare(reason + " (the process group's timeout)")
        deadline = time.monotonic() + COLLECT_SECONDS + 15
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.1)

    def _connect(self) -> None:
        store = _job_store(self.state)
        if store is None:
            return
        # So a report can name a process that cannot answer.
        store.set(f"pid/{self.state.process_index}", f"{socket.gethostname()}:{os.getpid()}")
        with self._store_lock:
            self._store = store
            early = getattr(self, "_local_declaration", None)
            if early is not None:  # declared by the main thread before the store was here
                store.compare_set(_DECLARED, "", early)

    def _run(self) -> None:
        try:
            self._connect()
            while not self._stop.is_set():
                self._wake.wait(self.period)
                if self._stop.is_set() or not _group_alive(self.state):
                    return
                if self._declared.is_set() or self._hang_declared():
                    self._respond()
                    return
                reason = self.stalled()
                if reason is not None:
                    self.declare(reason)
        except Exception as error:  # the store is gone: the job is ending anyway
            if not self._stop.is_set() and debug_watchdog():
                print(f"slipstream: hang watchdog stopped: {error!r}", file=sys.stderr)

    def _hang_declared(self) -> bool:
        return self._store is not None and bool(self._store.check([_DECLARED]))

    # -- answering ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """This process's account: where it is, its last collectives, its step."""
        from ..runtime import shared_memory_all_reduce
        from .flight_recorder import read_flight_recorder  # loaded by start()
        from .stacks import thread_stack

        state = self.state
        return {
            "rank": state.process_index,
            "local_rank": state.local_process_index,
            "world_size": state.num_processes,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": PROGRESS.step,
            "seconds_since_progress": round(time.monotonic() - PROGRESS.last_progress(), 3),
            "finishing": PROGRESS.finishing,
            "stack": thread_stack(),
            "collectives": COLLECTIVES.to_list(),
            "torch_collectives": read_flight_recorder(),
            "shared_memory_collectives": shared_memory_all_reduce.collectives(),
            "project_dir": self.project_dir(),
        }

    def _declaration(self) -> dict[str, Any]:
        if self._store is None:
            return dict(json.loads(getattr(self, "_local_declaration", "{}")))
        return dict(json.loads(self._store.get(_DECLARED)))

    def _respond(self) -> None:
        declared = self._declaration()
        mine = self.snapshot()
        rank = self.state.process_index
        folder = report_dir()
        if folder is not None:
            _write(Path(folder) / f"dump-rank{rank}.json", json.dumps(mine, default=str))
        if self._store is None:
            self.report = self._publish({rank: mine}, declared, print_it=folder is None)
        else:
            self._store.set(f"dump/{rank}", json.dumps(mine, default=str))
            if rank == 0:
                dumps = self._collect()
                self.report = self._publish(dumps, declared, print_it=folder is None)
                self._store.set(_REPORT, self.report)
                self._wait_for_acks(len(dumps) - 1)
            else:
                self._receive_report(declared, folder)
        self._finish()

    def _collect(self) -> dict[int, dict[str, Any]]:
        store, world = self._store, self.state.num_processes
        keys = [f"dump/{r}" for r in range(world)]
        deadline = time.monotonic() + COLLECT_SECONDS
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)
        return {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}

    def _pids(self, answered: set[int]) -> dict[int, str]:
        """``host:pid`` of the processes that did not answer."""
        store, pids = self._store, {}
        for rank in range(self.state.num_processes):
            key = f"pid/{rank}"
            if rank not in answered and store is not None and store.check([key]):
                pids[rank] = store.get(key).decode()
        return pids

    def _wait_for_acks(self, expected: int) -> None:
        # Rank 0 may host the store (without torchrun): it stays until the others read.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and int(self._store.add(_ACKS, 0)) < expected:
            time.sleep(0.05)

    def _receive_report(self, declared: dict[str, Any], folder: str | None) -> None:
        store = self._store
        deadline = time.monotonic() + COLLECT_SECONDS + 5.0
        while time.monotonic() < deadline and not store.check([_REPORT]):
            time.sleep(0.1)
        if store.check([_REPORT]):
            self.report = store.get(_REPORT).decode()
            if folder is not None and self.state.local_process_index == 0:
                name = report_file_name(self.state.launch.restart_count)
                _write(Path(folder) / name, self.report)
        elif self.state.local_process_index == 0:  # rank 0 is silent: report what answered
            self.report = self._publish(self._collect(), declared, print_it=folder is None)
        store.add(_ACKS, 1)

    def _publish(
        self, dumps: dict[int, dict[str, Any]], declared: dict[str, Any], print_it: bool
    ) -> str:
        """Write the report and the dumps to the project folder and the launcher's."""
        from .hang_report import build_report  # loaded by start()

        stamp = time.strftime("%Y%m%d-%H%M%S")
        project = self.project_dir()
        base = Path(project) / "diagnostics" if project else Path("slipstream-diagnostics")
        details = base / f"hang-{stamp}.json"
        text, _ = build_report(
            dumps,
            self.state.num_processes,
            declared,
            details=str(details.resolve()),
            exit_code=HANG_EXIT_CODE,
            pids=self._pids(set(dumps)),
        )
        everything = {"declared": declared, "processes": dumps}
        _write(details, json.dumps(everything, indent=1, default=str))
        _write(base / f"hang-{stamp}.txt", text + "\n")
        folder = report_dir()
        if folder is not None:
            _write(Path(folder) / report_file_name(self.state.launch.restart_count), text)
        if print_it:
            print(text, file=sys.stderr, flush=True)
        return text

    def _finish(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._exit(HANG_EXIT_CODE)


def _group_alive(state: ProcessState) -> bool:
    """False once this job's process group was torn down (the script ended)."""
    if state.num_processes == 1:
        return True
    import torch.distributed as dist

    return dist.is_initialized()


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader never sees half a file)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + f".{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)


_watchdog: HangWatchdog | None = None


def start_hang_watchdog(
    state: ProcessState,
    timeout: float | None,
    project_dir: Callable[[], str | None] = lambda: None,
) -> HangWatchdog | None:
    """Start this process's watchdog (or retune the running one); ``timeout=None`` stops it.

    Example::

        start_hang_watchdog(state, 600.0, lambda: "runs/a")
    """
    global _watchdog
    if _watchdog is not None and (timeout is None or _watchdog.state is not state):
        _watchdog.stop()
        _watchdog = None
    if timeout is None:
        return None
    # A new training run starts now: it is armed again at its first optimizer step.
    PROGRESS.mark()
    PROGRESS.armed = False
    if _watchdog is not None:
        _watchdog.timeout, _watchdog.project_dir = timeout, project_dir
        return _watchdog
    _watchdog = HangWatchdog(state, timeout, project_dir)
    _watchdog.start()
    return _watchdog


def watch_for_hangs(
    state: ProcessState,
    requested: float | timedelta | None,
    launch: dict[str, Any],
    project: Any = None,
) -> HangWatchdog | None:
    """What the Accelerator calls: resolve ``hang_timeout`` (see :func:`resolve_hang_timeout`)
    and start the watchdog; ``project`` is its ``ProjectConfiguration`` (reports go to its
    ``project_dir``)."""
    timeout = resolve_hang_timeout(requested, launch, state.timeout, state.num_processes)
    if state.num_processes > 1 or fault_tolerance_environment()["replica_id"]:
        # Kept where the launcher reads it when this process crashes or is killed.
        open_flight_file(state.process_index, report_dir())
    return start_hang_watchdog(state, timeout, lambda: getattr(project, "project_dir", None))


def stop_hang_watchdog(wait: float = 0.0) -> None:
    """Stop this process's watchdog (waiting up to ``wait`` seconds for its thread)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop(wait)
        _watchdog = None


def _at_exit() -> None:
    # A process that finished its script is not stuck. This usually runs after the process
    # state's exit barrier (registered later, so run earlier), during which the watchdog
    # still answers a hang the others declare; then the thread ends before the interpreter
    # does, so it is never inside the store's native code at shutdown.
    PROGRESS.finishing = True
    stop_hang_watchdog(wait=2.0)


atexit.register(_at_exit)
