"""The launcher's account of a failed job: one traceback, one line per other process.

When a process raises, torchrun's agent stops the others (SIGTERM) and reports every
process it saw fail, each with its full traceback, after its own warning lines. Most of
those reports are the same error again, or a process stopped because the first one died.
:func:`failure_summary` prints the first real failure once, labelled with its rank, and one
line for each other process; :func:`quiet_torchelastic` hides the agent's log lines unless
asked for (``slipstream launch --debug``, ``LOGLEVEL=INFO``).

The worker wrapper (:mod:`slipstream.launcher.worker`) writes each error file with a
``slipstream`` block (:data:`FAILURE_KEY`) this module reads: when the error was raised
(sub-second, unlike torchelastic's whole seconds), whether it was caused by a lost peer,
the exception's type and its one-line message.

Example::

    try:
        run(torchrun_args)
    except ChildFailedError as failure:
        print(failure_summary(failure.failures), file=sys.stderr)
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.diagnostics.hang_report import describe_ranks

#: The key of slipstream's own block in a worker's error file.
FAILURE_KEY = "slipstream"
#: Beyond this many other processes, processes with the same outcome share one line.
MAX_LINES_PER_RANK = 8
#: torch's loggers whose records describe the workers' fate, which the summary replaces.
#: Rendezvous loggers stay: their warnings are about machines that cannot reach each other.
NOISY_LOGGERS = (
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.agent",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing.spawn",  # "Terminating process N via signal SIGTERM" (forked workers)
)


#: The signals torchrun's agent stops workers with (then SIGKILL after the grace period).
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGKILL), int(signal.SIGINT)}
_KILLED = (
    "killed by SIGKILL: the out-of-memory killer (see `dmesg`), a scheduler, or the "
    "launcher after the grace period"
)


@dataclass(frozen=True)
class ProcessOutcome:
    """How one failed process ended, from torchelastic's ``ProcessFailure``."""

    rank: int
    exitcode: int
    #: ``"TypeName: message"`` from the error file (``None`` without one).
    error: str | None
    traceback: str | None
    #: When the worker recorded the error (seconds since the epoch), else when the agent saw it.
    time: float
    caused_by_peer: bool
    #: The error is the user's input (a ``ConfigError``): shown as one line.
    config_error: bool = False
    #: ``file:line`` of the script where it was raised, when known.
    site: str | None = None

    @property
    def crashed(self) -> bool:
        """Killed by a signal the launcher does not send (SIGABRT, SIGSEGV...): a crash of
        its own, in native code."""
        return self.exitcode < 0 and -self.exitcode not in _STOP_SIGNALS

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def outcome_of(rank: int, failure: Any) -> ProcessOutcome:
    """Read a torchelastic ``ProcessFailure`` (and slipstream's block in its error file)."""
    data = failure.error_file_data if isinstance(failure.error_file_data, Mapping) else {}
    block = data.get(FAILURE_KEY)
    ours: Mapping[str, Any] = block if isinstance(block, Mapping) else {}
    message = data.get("message")
    error: str | None = None
    trace: str | None = None
    if isinstance(message, Mapping):
        error = str(message.get("message", "")) or None
        extra = message.get("extraInfo")
        if isinstance(extra, Mapping):
            trace = str(extra.get("py_callstack", "")) or None
    elif isinstance(message, str) and message != "<NONE>":
        error = message
    return ProcessOutcome(
        rank=rank,
        exitcode=int(failure.exitcode),
        error=error,
        traceback=trace,
        time=float(ours.get("time", failure.timestamp)),
        caused_by_peer=bool(ours.get("caused_by_peer", False)),
        config_error=bool(ours.get("config_error", False)),
        site=str(ours["site"]) if ours.get("site") else None,
    )


def root_cause(outcomes: list[ProcessOutcome]) -> ProcessOutcome:
    """The failure that started it: an error the process raised itself (not one caused by a
    lost peer) before the rest, else one that exited on its own, else the earliest."""

    def order(outcome: ProcessOutcome) -> tuple[int, float, int]:
        if outcome.error is not None and not outcome.caused_by_peer:
            tier = 0
        elif (outcome.exitcode > 0 or outcome.crashed) and not outcome.caused_by_peer:
            tier = 1
        elif outcome.exitcode == -int(signal.SIGKILL):
            # The out-of-memory killer's signal; the launcher sends it only to a process
            # that ignored SIGTERM for the whole grace period.
            tier = 2
        elif outcome.error is not None:
            tier = 3
        else:
            tier = 4
        return (tier, outcome.time, outcome.rank)

    return min(outcomes, key=order)


def _one_line(text: str, limit: int = 160) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


def describe_other(outcome: ProcessOutcome, root: ProcessOutcome) -> str:
    """One line on a process other than the root cause (without its rank)."""
    name = outcome.signal_name
    if outcome.error is None:
        if name is None:
            return f"exited with code {outcome.exitcode}"
        if outcome.crashed:
            return f"killed by {name} (a crash in native code: its own output above says why)"
        if outcome.exitcode == -int(signal.SIGKILL):
            return _KILLED
        return f"stopped by the launcher ({name})"
    if outcome.caused_by_peer:
        what = f"lost its peers ({outcome.error.split(':', 1)[0]})"
    elif outcome.error == root.error:
        what = "raised the same error"
    else:
        what = _one_line(outcome.error)
    return what + (f", then was stopped ({name})" if name else f" (exit code {outcome.exitcode})")


def last_collectives(failures: Mapping[int, Any], flights: Mapping[int, Any]) -> list[str]:
    """One line per failed process whose flight file (kept in the launcher's report folder,
    see :mod:`slipstream.runtime.flight_file`) names its last collective."""
    lines = []
    for rank, failure in sorted(failures.items()):
        record = flights.get(int(getattr(failure, "pid", -1) or -1))
        if record is None:
            continue
        calls = record["collectives"]
        if not calls:
            lines.append(f"    rank {rank}: no slipstream collective yet (step {record['step']})")
            continue
        last = calls[-1]
        where = "inside" if last["finished"] is None else "last finished"
        lines.append(
            f"    rank {rank}: {where} {last['op']} #{last['seq']} ({last['data']}) at "
            f"{last['site']}, after step {record['step']}"
        )
    return lines


def crash_hint(
    outcomes: Sequence[ProcessOutcome], collectives: list[str], debug: bool
) -> list[str]:
    """What to read and do after a crash in native code: where each process was (from the
    flight files) and, unless already on, ``--debug``."""
    if not any(outcome.crashed for outcome in outcomes):
        return []
    lines = []
    if collectives:
        lines += [
            "  each process's last slipstream collective (gather, reduce, ...):",
            *collectives,
        ]
    if not debug:
        lines.append(
            '  if its output above says "collective mismatch", the processes called different '
            "collectives (one skipped or reordered one): rerun with `slipstream launch --debug`, "
            "which checks each collective on every process and names the line where they differ"
        )
    return lines


def failure_summary(
    failures: Mapping[int, Any],
    world_size: int | None = None,
    *,
    flights: Mapping[int, Any] | None = None,
    debug: bool = False,
) -> str:
    """What ``slipstream launch`` prints when processes failed: the root cause's traceback
    once, labelled with its rank, then one line per other failed process (processes with the
    same outcome share a line when there are more than :data:`MAX_LINES_PER_RANK`).

    Example::

        print(failure_summary(child_failed_error.failures, world_size=4), file=sys.stderr)
    """
    outcomes = [outcome_of(rank, failure) for rank, failure in sorted(failures.items())]
    root = root_cause(outcomes)
    of = f" of {world_size}" if world_size else ""
    header = f"slipstream launch: rank {root.rank}{of} failed"
    if root.exitcode > 0:
        header += f" (exit code {root.exitcode})"
    elif root.exitcode == -int(signal.SIGKILL):
        header += f" ({_KILLED})"
    elif root.signal_name:
        header += f" (killed by {root.signal_name})"
        if root.crashed:
            header += ", a crash in native code"
    lines: list[str] = []
    others = [o for o in outcomes if o.rank != root.rank]
    if root.config_error and root.error:
        # The user's input, like a bad flag: one line (where the script passed it), and
        # none for the processes that raised the same or were stopped for it.
        where = f" (at {root.site})" if root.site else ""
        alike = all(o.error == root.error or o.error is None for o in others)
        if alike:
            everywhere = " on every process" if len(outcomes) > 1 else ""
            return f"slipstream launch: {root.error}{where}{everywhere}"
        lines.append(f"{header}: {root.error}{where}")
    elif root.traceback:
        lines += [header + ":", root.traceback.rstrip()]
    elif root.error:
        lines += [header + ": " + root.error]
    elif root.exitcode > 0:
        lines += [
            header + " without a Python traceback: the script called sys.exit() or "
            "os._exit(), or crashed in native code (look above for its own output)"
        ]
    else:
        lines += [header + " without a Python traceback (look above for its own output)"]
    if len(others) <= MAX_LINES_PER_RANK:
        lines += [f"  rank {o.rank}: {describe_other(o, root)}" for o in others]
    else:
        grouped: dict[str, list[int]] = {}
        for outcome in others:
            grouped.setdefault(describe_other(outcome, root), []).append(outcome.rank)
        lines += [f"  {describe_ranks(ranks)}: {text}" for text, ranks in grouped.items()]
    lines += crash_hint(outcomes, last_collectives(failures, flights or {}), debug)
    return "\n".join(lines)


def exit_code_of(failures: Mapping[int, Any]) -> int:
    """The job's exit code: the root cause's own, else the first positive one, else 1."""
    outcomes = [outcome_of(rank, failure) for rank, failure in sorted(failures.items())]
    root = root_cause(outcomes)
    if root.exitcode > 0:
        return root.exitcode
    codes = [o.exitcode for o in outcomes if o.exitcode > 0]
    return codes[0] if codes else 1


@contextlib.contextmanager
def quiet_torchelastic(enabled: bool = True) -> Iterator[None]:
    """Hide the agent's warnings and errors about its workers inside the block (the
    summary says the same once); critical records still show. No-op when not ``enabled``."""
    if not enabled:
        yield
        return
    manager = logging.Logger.manager
    names = [
        name
        for name in [*NOISY_LOGGERS, *list(manager.loggerDict)]
        if name.startswith(NOISY_LOGGERS)
    ]
    loggers = [logging.getLogger(name) for name in dict.fromkeys(names)]
    saved = [(logger, logger.level) for logger in loggers]
    _quieted.extend(saved)
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        restore_torchelastic_logging()


#: The loggers :func:`quiet_torchelastic` quieted, with their levels before.
_quieted: list[tuple[logging.Logger, int]] = []


def restore_torchelastic_logging() -> None:
    """Give the loggers :func:`quiet_torchelastic` quieted their levels back (a worker forked
    from the launcher inside the block logs as a fresh process would)."""
    for logger, level in reversed(_quieted):
        logger.setLevel(level)
    _quieted.clear()
