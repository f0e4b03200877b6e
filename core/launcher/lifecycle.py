"""Worker processes end when the process that started them dies.

torchrun's agent starts workers in sessions of their own and multiprocessing does not stop
children either, so a launcher killed with SIGKILL (an OOM killer, a scheduler, ``kill -9``)
used to leave its workers running — on a GPU machine holding the GPUs' memory. Each worker
therefore watches its parent: on Linux the kernel sends it SIGTERM the moment the parent
dies (``PR_SET_PDEATHSIG``), and everywhere a daemon thread notices a changed parent within a
fraction of a second and ends the process, SIGKILL after a short grace.

Example (done for you by ``slipstream launch``, ``notebook_launcher`` and the Lightning
strategy's spawned processes)::

    watch_parent()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

#: How often the watchdog looks at its parent, and how long a worker told to stop may take
#: before it is killed: together well within the 5 seconds a worker may outlive its launcher.
POLL_SECONDS = 0.25
GRACE_SECONDS = 2.0

_watching: int | None = None


def _parent_death_signal(signum: int) -> None:
    """Ask the Linux kernel to send ``signum`` when the parent process exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signum, 0, 0, 0)


def _end_process(reason: str) -> None:
    print(f"slipstream: {reason}; this worker stops", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os._exit(1)  # the SIGTERM was handled and the process is still here


def watch_parent(parent: int | None = None) -> None:
    """End this process when ``parent`` (default: the current parent) exits. Idempotent."""
    global _watching
    parent = os.getppid() if parent is None else parent
    if _watching == parent:
        return
    _watching = parent
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # it died before the kernel was told to tell us
        _end_process(f"the launcher (process {parent}) is gone")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        _end_process(f"the launcher (process {parent}) died")

    threading.Thread(target=watch, name="slipstream-parent-watch", daemon=True).start()


def child_processes(pid: int | None = None) -> list[int]:
    """The direct children of ``pid`` (default: this process), from /proc (Linux)."""
    pid = os.getpid() if pid is None else pid
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
    return sorted(set(children))


def forward_signals(signals: list[int]) -> None:
    """Pass ``signals`` received by this process (the launcher) on to its children (the
    workers) instead of dying of them: SIGUSR1 from SLURM's ``--signal`` means "save and
    stop", which only the workers can do."""

    def forward(signum: int, frame: object) -> None:
        for child in child_processes():
            with contextlib.suppress(OSError):
                os.kill(child, signum)

    for signum in signals:
        signal.signal(signum, forward)
