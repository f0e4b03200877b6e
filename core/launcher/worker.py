"""What ``slipstream launch`` runs in each worker: the user's script or module, as
``python script.py`` would, recording an uncaught exception in torchrun's error file.

The launcher's failure summary then shows the traceback once, labelled with the rank.

Usage (by the launcher)::

    python -m slipstream.launcher.worker [--replica_group NAME] [--module] TARGET [ARGS...]
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

from ..options.errors import ConfigError
from ..runtime.env import error_file, fault_tolerance_environment
from .failures import FAILURE_KEY
from .lifecycle import watch_parent

# Messages of errors a rank gets because *another* rank died (gloo, NCCL, the TCP store).
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "NCCL communicator was aborted",
    "failed to recv, got 0 bytes",
    "ended during the shared-memory all-reduce",  # (slipstream.runtime.shared_memory_all_reduce)
)
#: How long a rank hit by a peer's failure waits for the launcher to stop it, so the peer's
#: own traceback (the real cause) is the one reported.
PEER_FAILURE_GRACE_SECONDS = 5.0


def caused_by_peer(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) says another process went away."""
    seen: BaseException | None = error
    while seen is not None:
        if any(marker in str(seen) for marker in _PEER_FAILURE_MARKERS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _user_traceback(error: BaseException) -> str:
    """The traceback without this bootstrap's and runpy's frames."""
    tb = error.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _script_site(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the script (outside slipstream and torch)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = None
    for frame in traceback.extract_tb(error.__traceback__):
        name = frame.filename
        if name.startswith(package) or "runpy" in name or f"{os.sep}site-packages{os.sep}" in name:
            continue
        site = f"{name}:{frame.lineno}"
    return site


def _record(error: BaseException, path: str, *, raised_at: float, by_peer: bool) -> None:
    """Write the error file torchrun asked for, in torchelastic's documented format, plus
    slipstream's block (when it was raised, to the sub-second, and whether a lost peer
    caused it): the launcher's summary picks the first real failure from them and prints
    its traceback once, labelled with the rank."""
    report = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": _user_traceback(error),
                "timestamp": str(int(raised_at)),
            },
        },
        FAILURE_KEY: {
            "time": raised_at,
            "caused_by_peer": by_peer,
            # The user's input (a layout that does not fit, say): one line, not a traceback.
            "config_error": isinstance(error, ConfigError),
            "site": _script_site(error),
        },
    }
    with open(path, "w") as handle:
        json.dump(report, handle)


def _finished() -> None:
    """The script ended well: in a fault-tolerant job, mark the training finished now,
    before this process leaves the quorum (at exit), so that a replica group restarted
    from here on stops instead of training alone (the launcher marks it too, but only once
    this group's agent has ended: too late for a group restarted meanwhile)."""
    mark = fault_tolerance_environment()["finished_file"]
    if mark:
        with contextlib.suppress(OSError):
            open(mark, "a").close()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--replica_group"]:
        # Only there for `ps` to show which replica group this process belongs to.
        args = args[2:]
    as_module = bool(args) and args[0] == "--module"
    if as_module:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m slipstream.launcher.worker [--module] TARGET [ARGS...]")
    target = args[0]
    sys.argv = [target, *args[1:]]
    watch_parent()  # the launcher: if it dies, so does this worker
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        _finished()
    except SystemExit as stop:
        if stop.code in (None, 0):
            _finished()
        raise
    except KeyboardInterrupt:
        # Ctrl-C reaches every worker at once: stop quietly (the launcher reports it once)
        # instead of a traceback from each rank.
        sys.exit(128 + signal.SIGINT)
    except BaseException as error:
        from ..runtime.flight import is_timeout, report_timeout
        from ..runtime.process_exit import note_failure

        if is_timeout(error):  # a collective torch timed out: report the hang first
            report_timeout(f"{type(error).__name__} in the script: {str(error)[:120]}")
        note_failure()
        raised_at = time.time()
        path = error_file()
        if path is None:
            raise
        by_peer = caused_by_peer(error)
        if by_peer:
            time.sleep(PEER_FAILURE_GRACE_SECONDS)
        _record(error, path, raised_at=raised_at, by_peer=by_peer)
        # A configuration error (bad parallel sizes, say) is the user's input, like a bad
        # flag: exit code 2, which the launcher passes on.
        sys.exit(2 if isinstance(error, ConfigError) else 1)


if __name__ == "__main__":
    main()
