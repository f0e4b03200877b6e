"""Start a training script on every process of a job, with torchrun's elastic agent.

``slipstream launch`` resolves its configuration (flags > config file > defaults), hands it to
the workers in one environment variable and runs ``torch.distributed.run`` in-process: the
agent spawns the workers, restarts them (``max_restarts``), and stops all of them as soon as
one fails. Multi-machine jobs use torchrun's c10d rendezvous (or its static one).

Example::

    request = LaunchRequest(LaunchConfig(num_processes=2, use_cpu=True), "train.py", [])
    exit_code = launch(request)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field

from ..runtime.env import REPORT_DIR_VARIABLE, agent_logs_requested, export_for_workers, is_set
from .agent_events import agent_events
from .config import LaunchConfig
from .elastic import ELASTIC_AGENT_VARIABLES, elastic_torchrun_flags, is_elastic
from .failures import exit_code_of, failure_summary, quiet_torchelastic
from .forked import fork_wanted, run_agent
from .reports import HangReports


@dataclass(frozen=True)
class LaunchRequest:
    """What to run and how."""

    config: LaunchConfig
    script: str
    script_args: list[str] = field(default_factory=list)
    #: Run ``script`` as a module (``python -m``).
    module: bool = False
    #: Run ``script`` as an executable, not with Python.
    no_python: bool = False


def torchrun_arguments(request: LaunchRequest) -> list[str]:
    """The ``torchrun`` command line equivalent to ``request``.

    Example::

        torchrun_arguments(LaunchRequest(LaunchConfig(num_processes=2), "train.py", ["--lr", "1"]))
        # ['--nproc_per_node=2', ..., '--module', 'slipstream.launcher.worker', 'train.py',
        #  '--lr', '1']
    """
    flags, entry, entry_args = _torchrun_parts(request)
    return [*flags, entry, *entry_args]


def _torchrun_parts(request: LaunchRequest) -> tuple[list[str], str, list[str]]:
    """``(launcher flags, entry point, the entry point's arguments)`` for ``request``: kept
    apart so the script's own arguments never go through torchrun's parser."""
    config = request.config
    per_machine = config.num_processes // config.num_machines
    args = [
        f"--nproc_per_node={per_machine}",
        f"--nnodes={config.num_machines}",
        f"--max_restarts={config.max_restarts}",
        f"--monitor_interval={config.monitor_interval}",
    ]
    if is_elastic(config):
        args = [*args[:1], *args[2:], *elastic_torchrun_flags(config)]
    elif config.num_machines == 1 and config.main_process_port is None:
        # torchrun picks a free port itself, without a race between choosing and binding.
        args.append("--standalone")
    elif config.num_machines == 1:
        ip = config.main_process_ip or "127.0.0.1"
        args += [f"--master_addr={ip}", f"--master_port={config.main_process_port}"]
    elif config.rdzv_backend == "static":
        args += [
            "--rdzv_backend=static",
            f"--node_rank={config.machine_rank}",
            f"--master_addr={config.main_process_ip}",
            f"--master_port={config.main_process_port or 29500}",
        ]
    else:
        port = config.main_process_port or 29500
        is_host = "true" if config.machine_rank == 0 else "false"
        args += [
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={config.main_process_ip}:{port}",
            f"--rdzv_id=slipstream-{port}",
            f"--rdzv_conf={','.join(filter(None, [f'is_host={is_host}', config.rdzv_conf]))}",
        ]
    if request.no_python:
        return [*args, "--no_python"], request.script, list(request.script_args)
    # Every worker runs through slipstream.launcher.worker, which records a crash for the summary.
    target = ["--module", request.script] if request.module else [request.script]
    return [*args, "--module"], "slipstream.launcher.worker", [*target, *request.script_args]


def torchrun_namespace(request: LaunchRequest) -> argparse.Namespace:
    """torchrun's parsed arguments for ``request``, as ``torch.distributed.run.run`` takes them.

    Only the launcher's own flags and the entry point go through torchrun's parser: it
    accepts abbreviations, so a script's ``--start`` would be read as ``--start-method`` (or
    be refused as ambiguous) and ``--num`` as ``--numa-binding``. The script's arguments are
    set afterwards, verbatim.

    Example::

        namespace = torchrun_namespace(LaunchRequest(config, "train.py", ["--start", "0"]))
        namespace.training_script_args  # ['train.py', '--start', '0'] (after the worker)
    """
    from torch.distributed.run import get_args_parser

    flags, entry, entry_args = _torchrun_parts(request)
    namespace = get_args_parser().parse_args([*flags, entry])
    namespace.training_script_args = entry_args
    return namespace


def worker_variables(config: LaunchConfig) -> dict[str, str]:
    """Extra variables for the workers: device visibility and CPU threads."""
    extra: dict[str, str] = {}
    if config.use_cpu:
        extra["CUDA_VISIBLE_DEVICES"] = ""
    elif config.gpu_ids not in ("all", ""):
        extra["CUDA_VISIBLE_DEVICES"] = config.gpu_ids
    per_machine = config.num_processes // config.num_machines
    # How long stopping workers get (after SIGTERM) before torchrun's agent kills them.
    extra["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(config.termination_grace_period))
    if is_elastic(config):
        extra.update(ELASTIC_AGENT_VARIABLES)
    if not is_set("OMP_NUM_THREADS") and per_machine > 1:
        # torchrun would use 1 thread per worker; on CPU share the cores instead.
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_machine))
    return extra


def launch(request: LaunchRequest) -> int:
    """Run the job; returns the exit code (0 when every worker succeeded, 128 + N when the
    launcher was stopped by signal N, :data:`REQUEUE_EXIT_CODE` when the workers saved a
    checkpoint because the job was preempted, :data:`HANG_EXIT_CODE` when they reported a
    hang; else the first failing worker's)."""
    config = request.config
    # The workers leave hang reports here; the launcher prints them as they come.
    folder = tempfile.mkdtemp(prefix="slipstream-launch-")
    extra = {**worker_variables(config), REPORT_DIR_VARIABLE: folder}
    if config.fault_tolerance_config:  # replica groups, each under its own agent
        from .fault_tolerant import launch_fault_tolerant

        def group_arguments(group: LaunchConfig) -> tuple[list[str], str, list[str]]:
            return _torchrun_parts(
                LaunchRequest(
                    group, request.script, request.script_args, request.module, request.no_python
                )
            )

        code = launch_fault_tolerant(request, extra, group_arguments)
        shutil.rmtree(folder, ignore_errors=True)
        return code
    export_for_workers(config.worker_settings(), extra)
    with HangReports(folder) as reports:
        code = _run(request, reports)
    shutil.rmtree(folder, ignore_errors=True)
    return code


def _run(request: LaunchRequest, reports: HangReports) -> int:
    """Run torchrun's agent and turn its outcome into an exit code and one account."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..diagnostics.hang import HANG_EXIT_CODE
    from ..runtime.preemption import REQUEUE_EXIT_CODE, signal_numbers
    from .lifecycle import forward_signals

    config = request.config
    # torchrun's agent stops the workers on SIGTERM/SIGINT itself (then waits the grace
    # period); other preemption signals (SLURM's SIGUSR1) go to the workers, who save.
    death = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
    forward_signals([s for s in signal_numbers(config.preemption_signals) if s not in death])
    torchrun_args = torchrun_namespace(request)
    # The agent's own lines (a warning per stopped worker, an error per failed one) say
    # again what the summary below says once; they show with --debug, --verbose or LOGLEVEL.
    verbose = config.debug or config.verbose or agent_logs_requested()
    try:
        with (
            quiet_torchelastic(enabled=not verbose),
            agent_events(None, str(reports.folder), elastic=is_elastic(config)),
        ):
            run_agent(torchrun_args, fork=fork_wanted(config, request.no_python))
    except SignalException as stopped:
        print(
            f"slipstream launch: stopped by {signal.Signals(stopped.sigval).name}; the "
            "workers were asked to stop",
            file=sys.stderr,
        )
        return 128 + int(stopped.sigval)
    except ChildFailedError as failure:
        if reports.collect():  # the workers reported a hang and ended themselves
            print(
                f"slipstream launch: the job hung (report above); exit code {HANG_EXIT_CODE}",
                file=sys.stderr,
            )
            return HANG_EXIT_CODE
        codes = [f.exitcode for f in failure.failures.values() if f.exitcode and f.exitcode > 0]
        if codes and all(code == REQUEUE_EXIT_CODE for code in codes):
            print(
                "slipstream launch: the job was preempted; the workers saved a checkpoint "
                f"and stopped (exit code {REQUEUE_EXIT_CODE}: requeue, then resume)",
                file=sys.stderr,
            )
            return REQUEUE_EXIT_CODE
        from ..runtime.flight_file import read_flight_files

        world = None if is_elastic(config) else config.num_processes  # it changes
        flights = read_flight_files(reports.folder)
        summary = failure_summary(failure.failures, world, flights=flights, debug=config.debug)
        print(summary, file=sys.stderr)
        return exit_code_of(failure.failures)
    return 0
