"""``slipstream launch --fault_tolerance``: each replica group runs under its own torchrun
agent, so a group that fails is restarted (``--max_restarts``) while the others go on.

The launcher starts a torchft lighthouse unless the configuration names one
(``fault_tolerance_config: {lighthouse: http://HOST:PORT}``), gives every group its name
(``replica_0`` ...) and the lighthouse's address, and ends when every group has ended: with
0 when any group finished its training, else with the first failing group's code.

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
    request: Any, extra: dict[str, str], torchrun_arguments: Callable[[LaunchConfig], list[str]]
) -> int:
    """Run ``request`` (a :class:`~slipstream.launcher.launch.LaunchRequest`) as replica
    groups; ``extra`` are the variables every worker gets, ``torchrun_arguments`` gives
    torchrun's arguments for one group's configuration."""
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
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_arguments(group_config)]
    # Created once a group finished: a group restarted later stops instead of starting over.
    scratch = None if extra.get(REPORT_DIR_VARIABLE) else tempfile.mkdtemp(prefix="slipstream-ft-")
    finished = Path(extra.get(REPORT_DIR_VARIABLE) or str(scratch)) / "ft-finished"
    children: list[subprocess.Popen[bytes]] = []
    # torchft's manager logs every quorum and vote at INFO; --verbose (or RUST_LOG) shows them.
    quiet = {} if config.verbose or is_set("RUST_LOG") else {"RUST_LOG": "warn"}

    def stop(signum: int, _frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(groups):
            env = child_environment(
                {
                    **extra,
                    LAUNCH_CONFIG_VARIABLE: json.dumps(settings, sort_keys=True),
                    FT_REPLICA_ID_VARIABLE: f"replica_{index}",
                    FT_LIGHTHOUSE_VARIABLE: str(address),
                    FT_FINISHED_VARIABLE: str(finished),
                    **quiet,
                }
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
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    codes = [child.returncode for child in children]
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
