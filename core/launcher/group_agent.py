"""One replica group of ``slipstream launch --fault_tolerance``: torchrun's agent for the
group's processes, run in this process (one per group, so ``ps`` names the group), with the
agent's own log lines hidden and its events said once each: the group lost (how, at which
step, which restart follows). A group that ends for good with a Python error gets the
launcher's usual failure summary, labelled with the group.

Usage (by the launcher)::

    python -m slipstream.launcher.group_agent REPLICA_ID fork|exec N_FLAGS TORCHRUN_FLAGS... ENTRY ARGS...
"""

from __future__ import annotations

import sys

from ..runtime.env import agent_logs_requested, report_dir
from .agent_events import agent_events
from .failures import exit_code_of, failure_summary, outcome_of, quiet_torchelastic
from .forked import run_agent


def group_command(
    replica_id: str, flags: list[str], entry: str, args: list[str], *, fork: bool
) -> list[str]:
    """The command line that runs one group's agent (see the module docstring); with
    ``fork``, the agent forks its workers (see :mod:`slipstream.launcher.forked`)."""
    return [
        sys.executable, "-m", "slipstream.launcher.group_agent", replica_id,
        "fork" if fork else "exec", str(len(flags)), *flags, entry, *args,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    args = list(sys.argv[1:] if argv is None else argv)
    replica_id, start, count = args[0], args[1], int(args[2])
    flags, entry, entry_args = args[3 : 3 + count], args[3 + count], args[4 + count :]
    # Only the launcher's flags go through torchrun's parser (see launch.torchrun_namespace).
    namespace = get_args_parser().parse_args([*flags, entry])
    namespace.training_script_args = entry_args
    folder = report_dir()
    try:
        with (
            quiet_torchelastic(enabled=not agent_logs_requested()),
            agent_events(f"replica group {replica_id}", folder),
        ):
            run_agent(namespace, fork=start == "fork")
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    except ChildFailedError as failure:
        outcomes = [outcome_of(rank, f) for rank, f in failure.failures.items()]
        if any(outcome.error or outcome.crashed for outcome in outcomes):
            from ..runtime.flight_file import read_flight_files

            flights = read_flight_files(folder) if folder else {}
            summary = failure_summary(failure.failures, flights=flights)
            print(
                summary.replace("slipstream launch: ", f"slipstream launch: {replica_id}: ", 1),
                file=sys.stderr,
                flush=True,
            )
        return exit_code_of(failure.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
