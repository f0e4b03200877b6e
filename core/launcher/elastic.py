"""Elastic sizes: a job that runs on anywhere between MIN and MAX machines.

``slipstream launch --nnodes MIN:MAX`` starts torchrun's agent with its c10d elastic
rendezvous. When a machine is lost, the survivors' workers fail, their agents restart them
(this uses one of ``--max_restarts``) and the rendezvous settles on the machines still
there; when a machine joins, the running agents notice it and restart their workers at the
larger size (this uses none). Each time the script resumes from its latest checkpoint,
resharded to the new number of processes (``load_state("latest")``).

The batch follows ``elastic_batch``:

- ``global`` (default): the global batch stays what it is at MAX machines; each process's
  gradient accumulation grows when machines are missing (``gradient_accumulation_steps`` is
  the value at MAX machines).
- ``per_process``: each process keeps its batch and accumulation; the global batch shrinks
  and grows with the job.

Example::

    # on 10.0.0.1, which hosts the rendezvous (and must stay up):
    slipstream launch --nnodes 1:3 --nproc_per_node 2 --max_restarts 10 --machine_rank 0 \\
        --rdzv_endpoint 10.0.0.1:29400 train.py
    # on each other machine, whenever it is available:
    slipstream launch --nnodes 1:3 --nproc_per_node 2 --max_restarts 10 --machine_rank 1 \\
        --rdzv_endpoint 10.0.0.1:29400 train.py
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from ..optim.elastic import elastic_accumulation_steps
from ..options.errors import ConfigError


class LaunchConfig(Protocol):
    """The keys of :class:`~slipstream.launcher.config.LaunchConfig` read here (it is
    frozen: read-only properties)."""

    @property
    def num_processes(self) -> int: ...

    @property
    def num_machines(self) -> int: ...

    @property
    def min_machines(self) -> int | None: ...

    @property
    def elastic_batch(self) -> str: ...

    @property
    def rdzv_backend(self) -> str: ...

    @property
    def rdzv_conf(self) -> str: ...

    @property
    def distributed_type(self) -> str: ...

    @property
    def deepspeed_config(self) -> dict[str, Any]: ...

    @property
    def parallelism_config(self) -> dict[str, Any]: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def main_process_ip(self) -> str | None: ...

    @property
    def main_process_port(self) -> int | None: ...

    @property
    def machine_rank(self) -> int: ...


#: What an elastic job keeps when its size changes (config key ``elastic_batch``).
ELASTIC_BATCH = ("global", "per_process")
#: For the launcher (torchrun's agent runs in it) and its workers. torch 2.13's agents share
#: the rendezvous store with their workers, and a machine that stays rank 0 when another
#: joins does not publish the shared store's address for the new round, so the newcomer
#: waits for it until it times out; without sharing, rank 0 publishes an address each round.
ELASTIC_AGENT_VARIABLES = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"3"`` -> ``(3, 3)``, ``"1:3"`` -> ``(1, 3)``, as torchrun reads ``--nnodes``.

    Example::

        parse_nnodes("2:4")  # (2, 4)
    """
    parts = str(text).strip().split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if len(parts) > 2 or low < 1 or high < 1:
        raise ConfigError(
            f"--nnodes {text}: give a number of machines (2) or a range MIN:MAX (1:3) of "
            "positive integers"
        )
    if low > high:
        raise ConfigError(
            f"--nnodes {text}: MIN ({low}) is larger than MAX ({high}); write the smaller "
            f"number first (--nnodes {high}:{low})"
        )
    return low, high


def is_elastic(config: LaunchConfig) -> bool:
    """Whether ``config`` lets the number of machines change (MIN < MAX)."""
    return config.min_machines is not None and config.min_machines < config.num_machines


def machine_counts(config: LaunchConfig) -> range:
    """Every number of machines the job may run on."""
    low = config.num_machines if config.min_machines is None else config.min_machines
    return range(low, config.num_machines + 1)


def validate_elastic(config: LaunchConfig, where: str) -> None:
    """Check the elastic keys: the range, the rendezvous, and that the parallel layout and
    the batch work at every size in the range (so a resize never stops the job)."""
    if config.elastic_batch not in ELASTIC_BATCH:
        raise ConfigError(
            f"{where}: elastic_batch must be one of {', '.join(ELASTIC_BATCH)}, got "
            f"{config.elastic_batch!r}"
        )
    if config.min_machines is None:
        return
    if not 1 <= config.min_machines <= config.num_machines:
        raise ConfigError(
            f"{where}: min_machines ({config.min_machines}) must be between 1 and num_machines "
            f"({config.num_machines}), the most machines the job runs on (--nnodes MIN:MAX)"
        )
    if not is_elastic(config):
        return
    span = f"--nnodes {config.min_machines}:{config.num_machines}"
    if config.rdzv_backend != "c10d":
        raise ConfigError(
            f"{where}: {span} needs rdzv_backend: c10d (torchrun's elastic rendezvous); "
            f"rdzv_backend: {config.rdzv_backend} cannot change the number of machines"
        )
    if config.distributed_type == "DEEPSPEED" or config.deepspeed_config:
        raise ConfigError(
            f"{where}: {span} works with DDP and FSDP2, whose checkpoints reshard to a new "
            "number of processes; DeepSpeed's ZeRO checkpoints do not here: use FSDP2 "
            "(--use_fsdp) or a fixed --nnodes"
        )
    per_machine = config.num_processes // config.num_machines
    worlds = [machines * per_machine for machines in machine_counts(config)]
    if config.parallelism_config:
        _check_layouts(config, worlds, span, where)
    if config.elastic_batch == "global":
        _check_accumulation(config, worlds, span, where)


def _check_layouts(config: LaunchConfig, worlds: list[int], span: str, where: str) -> None:
    from ..parallel.config import CONFIG_PREFIX, MESH_DIMS, ParallelismConfig

    parallel = ParallelismConfig.from_config(config.parallelism_config)
    failing = []
    for world in worlds:
        try:
            parallel.resolve(world)
        except ConfigError:
            failing.append(world)
    if not failing:
        return
    fixed = {dim: getattr(parallel, f"{dim}_size") for dim in MESH_DIMS}
    others = math.prod(
        size for dim, size in fixed.items() if dim in ("pp", "cp", "tp") and size and size > 0
    )
    per_machine = config.num_processes // config.num_machines
    raise ConfigError(
        f"{where}: {span} with {per_machine} process(es) per machine runs on "
        f"{', '.join(map(str, worlds))} processes, but the parallelism_config layout does not "
        f"fit {', '.join(map(str, failing))}: keep the data-parallel sizes open "
        f"({CONFIG_PREFIX}dp_shard_size: -1, no fixed {CONFIG_PREFIX}dp_replicate_size) and "
        f"make the processes per machine (--nproc_per_node) a multiple of the other sizes' "
        f"product ({others})"
    )


def _check_accumulation(config: LaunchConfig, worlds: list[int], span: str, where: str) -> None:
    full = config.num_processes
    steps = config.gradient_accumulation_steps
    needed = math.lcm(*(world // math.gcd(full, world) for world in worlds))
    if steps % needed:
        raise ConfigError(
            f"{where}: {span} with elastic_batch: global keeps the global batch of "
            f"{full} processes x gradient_accumulation_steps={steps} at every size "
            f"({', '.join(map(str, worlds))} processes), which needs gradient_accumulation_steps "
            f"to be a multiple of {needed} (e.g. {needed * -(-steps // needed)}): change it, "
            "or set elastic_batch: per_process to keep each process's batch instead"
        )


def elastic_settings(config: LaunchConfig) -> dict[str, Any] | None:
    """What the workers' Accelerator needs to keep the batch (``None`` when not elastic)."""
    if not is_elastic(config):
        return None
    return {
        "batch": config.elastic_batch,
        "reference_world_size": config.num_processes,
        "min_machines": config.min_machines,
        "max_machines": config.num_machines,
    }


def elastic_torchrun_flags(config: LaunchConfig) -> list[str]:
    """torchrun's rendezvous flags for an elastic job. The launcher with ``machine_rank``
    0 hosts the rendezvous store at the endpoint (it must stay up); every other launcher
    connects to it. (Left to guess, launchers on one machine may each open a store on the
    same port and form separate jobs.)"""
    port = config.main_process_port or 29500
    is_host = "true" if config.machine_rank == 0 else "false"
    return [
        f"--nnodes={config.min_machines}:{config.num_machines}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={config.main_process_ip}:{port}",
        f"--rdzv_id=slipstream-{port}",
        f"--rdzv_conf={','.join(filter(None, [f'is_host={is_host}', config.rdzv_conf]))}",
    ]


__all__ = [
    "ELASTIC_AGENT_VARIABLES",
    "ELASTIC_BATCH",
    "elastic_accumulation_steps",
    "elastic_settings",
    "elastic_torchrun_flags",
    "is_elastic",
    "machine_counts",
    "parse_nnodes",
    "validate_elastic",
]
