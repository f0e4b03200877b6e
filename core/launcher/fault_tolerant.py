"""``slipstream launch --fault_tolerance``: each replica group runs under its own torchrun
agent, so a group that fails is restarted (``--max_restarts``) while the others go on.

The launcher starts a torchft lighthouse unless the configuration names one
(``fault_tolerance_config: {lighthouse: http://HOST:PORT}``), gives every group its name
(``replica_0`` ...) and the lighthouse's address, and ends when every group has ended: with
0 when any group finished its training, else with the first failing group's code.

What happens to the groups is said once each, as it happens (:mod:`slipstream.runtime.events`):
a group lost (by its agent, :mod:`~slipstream.launcher.group_agent`), a group rejoining (by
the group), and at the end one summary line per group. A group that finishes marks the job
finished itself before it leaves the quorum (a restarted group then stops instead of
training alone); the launcher marks it too once a group's agent ended with 0.

Example::

    slipstream launch --cpu -n 4 --fault_tolerance --ft_replica_groups 2 --max_restarts 3 train.py
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..fault_tolerance.lighthouse import Lighthouse
from ..runtime.env import (
    FT_FINISHED_VARIABLE,
    FT_LIGHTHOUSE_VARIABLE,
    FT_REPLICA_ID_VARIABLE,
    LAUNCH_CONFIG_VARIABLE,
    REPORT_DIR_VARIABLE,
    child_environment,
    is_set,
)
from .config import LaunchConfig
from .forked import fork_wanted
from .group_agent import group_command
from .reports import HangReports

#: The entry point torchrun starts for each worker (see launch._torchrun_parts).
WORKER_MODULE = "slipstream.launcher.worker"


def group_configs(config: LaunchConfig) -> tuple[int, LaunchConfig]:
    """``(groups, the configuration of one group)`` for a fault-tolerant job."""
    block = config.fault_tolerance_config
    groups = int(block.get("replica_groups") or config.num_processes)
    per_group = config.num_processes // groups
    distributed = config.distributed_type if per_group > 1 else "NO"
    return groups, config.replace(
        num_processes=per_group,
        num_machines=1,
        main_process_port=None,
        distributed_type=distributed,
        fault_tolerance_config={},  # the groups get the block with their names
    )


def launch_fault_tolerant(
    request: Any,
    extra: dict[str, str],
    torchrun_parts: Callable[[LaunchConfig], tuple[list[str], str, list[str]]],
) -> int:
    """Run ``request`` (a :class:`~slipstream.launcher.launch.LaunchRequest`) as replica
    groups; ``extra`` are the variables every worker gets, ``torchrun_parts`` gives
    torchrun's flags, entry point and its arguments for one group's configuration."""
    config: LaunchConfig = request.config
    if config.num_machines > 1:
        raise ValueError(
            "slipstream launch --fault_tolerance starts the replica groups of one machine; "
            "on several machines start one launch per group with --ft_lighthouse pointing at "
            "a shared torchft_lighthouse"
        )
    groups, group_config = group_configs(config)
    block = dict(config.fault_tolerance_config)
    block["replica_groups"] = groups
    settings = {**group_config.worker_settings(), "fault_tolerance_config": block}
    lighthouse: Lighthouse | None = None
    address = block.get("lighthouse")
    if not address:
        lighthouse = Lighthouse(
            int(block.get("min_replicas") or 1),
            heartbeat_timeout=float(block.get("heartbeat_timeout") or 5.0),
            join_timeout=float(block.get("join_timeout") or 5.0),
        ).start()
        address = lighthouse.address
    flags, entry, entry_args = torchrun_parts(group_config)
    # Created once a group finished: a group restarted later stops instead of starting over.
    scratch = None if extra.get(REPORT_DIR_VARIABLE) else tempfile.mkdtemp(prefix="slipstream-ft-")
    folder = Path(extra.get(REPORT_DIR_VARIABLE) or str(scratch))
    finished = folder / "ft-finished"
    children: list[subprocess.Popen[bytes]] = []
    # torchft's manager logs every quorum and vote at INFO; --verbose (or RUST_LOG) shows them.
    quiet = {} if config.verbose or is_set("RUST_LOG") else {"RUST_LOG": "warn"}

    def stop(signum: int, _frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    reports = HangReports(folder).__enter__()  # prints the groups' events as they come
    try:
        for index in range(groups):
            env = child_environment(
                {
                    **extra,
                    REPORT_DIR_VARIABLE: str(folder),
                    LAUNCH_CONFIG_VARIABLE: json.dumps(settings, sort_keys=True),
                    FT_REPLICA_ID_VARIABLE: f"replica_{index}",
                    FT_LIGHTHOUSE_VARIABLE: str(address),
                    FT_FINISHED_VARIABLE: str(finished),
                    **quiet,
                }
            )
            arguments = entry_args
            if entry == WORKER_MODULE:  # `ps` shows the group of each worker
                arguments = ["--replica_group", f"replica_{index}", *entry_args]
            command = group_command(
                f"replica_{index}",
                flags,
                entry,
                arguments,
                fork=fork_wanted(config, request.no_python),
            )
            children.append(subprocess.Popen(command, env=env))
        while any(child.poll() is None for child in children):
            if not finished.exists() and any(child.poll() == 0 for child in children):
                finished.touch()
            time.sleep(0.1)
    finally:
        stop(signal.SIGTERM, None)
        for child in children:
            try:
                child.wait(timeout=config.termination_grace_period + 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            lighthouse.stop()
        reports.__exit__(None, None, None)
        codes = [child.returncode for child in children]
        for line in group_summaries(folder, codes):
            print(f"slipstream launch: {line}", file=sys.stderr, flush=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if any(code == 0 for code in codes):
        failed = [i for i, code in enumerate(codes) if code != 0]
        if failed:
            print(
                f"slipstream launch: replica groups {failed} ended early (codes "
                f"{[codes[i] for i in failed]}); the others finished the training",
                file=sys.stderr,
            )
        return 0
    return next(code for code in codes if code != 0)


def group_summaries(folder: Path, codes: list[int | None]) -> list[str]:
    """One line per replica group: how it ended and what its lives did (the summaries its
    first process left at exit, :func:`slipstream.fault_tolerance.reporting.summary_file`;
    a life that was killed leaves none, so its steps are not counted)."""
    lines = []
    for index, code in enumerate(codes):
        lives = []
        for path in sorted(folder.glob(f"ft-summary-replica_{index}-life*.json")):
            try:
                lives.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        ended = "finished" if code == 0 else f"ended with code {code}"
        if not lives:
            lines.append(f"replica group replica_{index}: {ended} (it left no summary)")
            continue
        restarts = max(int(life["life"]) for life in lives)
        if code == 0 and any(life.get("stopped") for life in lives):
            ended = "stopped after its restart: the others had finished the training"
        else:
            ended += f" at step {max(int(life['step']) for life in lives)}"
        total = {
            key: sum(int(life[key]) for life in lives)
            for key in ("committed", "discarded", "recoveries")
        }
        unit = str(lives[0].get("unit") or "step")
        lines.append(
            f"replica group replica_{index}: {ended}; {total['committed']} "
            f"{unit}{'' if total['committed'] == 1 else 's'} committed, {total['discarded']} "
            f"discarded, {total['recoveries']} "
            f"recover{'y' if total['recoveries'] == 1 else 'ies'} from a peer, "
            f"{restarts} restart{'' if restarts == 1 else 's'}"
        )
    return lines
