"""The option object that turns on per-step fault tolerance (torchft replica groups).

Example::

    accelerator = Accelerator(
        fault_tolerance=FaultToleranceKwargs(min_replicas=1, lighthouse="http://host:29510")
    )
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .kwargs import KwargsHandler

#: Keys of the ``fault_tolerance_config:`` block of a launch config file.
CONFIG_KEYS = (
    "replica_groups",
    "min_replicas",
    "lighthouse",
    "heartbeat_timeout",
    "join_timeout",
    "timeout",
    "quorum_timeout",
)

#: ``slipstream launch`` flags of the block: (flag, key, type, help).
LAUNCH_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    (
        "ft_replica_groups",
        "replica_groups",
        int,
        "replica groups (divides num_processes; default: each process a group)",
    ),
    ("ft_min_replicas", "min_replicas", int, "fewest replica groups a step commits with"),
    ("ft_lighthouse", "lighthouse", str, "torchft lighthouse http://HOST:PORT (default: own)"),
    (
        "ft_heartbeat_timeout",
        "heartbeat_timeout",
        float,
        "seconds before a silent group counts as dead (the started lighthouse; default 5)",
    ),
)


@dataclass
class FaultToleranceKwargs(KwargsHandler):
    """Per-step fault tolerance over replica groups (torchft).

    Every replica group (one process under DDP, one FSDP2/TP group under HSDP) trains on
    its own samples; gradients are averaged across the groups of the current quorum. A
    group that dies costs the others the step it died in; a group that comes back copies
    the model, optimizer, scheduler, RNG and data position from a healthy peer.

    Args:
        min_replicas: the fewest replica groups a step may commit with.
        lighthouse: the torchft lighthouse's address (``http://host:port``); default the
            launcher's (``SLIPSTREAM_FT_LIGHTHOUSE`` or ``TORCHFT_LIGHTHOUSE``).
        replica_id: this group's name, ending in its index (``replica_3``); default the
            launcher's (``SLIPSTREAM_FT_REPLICA_ID``).
        replica_groups: how many groups the job runs when all are healthy (sizes
            ``len(loader)``); default the launcher's, else 1.
        timeout: seconds a gradient all-reduce, a commit vote or a recovery may take.
        quorum_timeout: seconds to wait for a quorum (a group waiting to rejoin waits here).
        enabled: ``False`` keeps the option object but trains without fault tolerance.
    """

    min_replicas: int = 1
    lighthouse: str | None = None
    replica_id: str | None = None
    replica_groups: int | None = None
    timeout: float = 60.0
    quorum_timeout: float = 300.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigError(
                f"FaultToleranceKwargs(min_replicas={self.min_replicas!r}): the fewest replica "
                "groups a step may commit with must be an integer >= 1"
            )
        if self.replica_groups is not None and self.replica_groups < self.min_replicas:
            raise ConfigError(
                f"FaultToleranceKwargs(replica_groups={self.replica_groups}) is below "
                f"min_replicas={self.min_replicas}: no step could ever commit; lower "
                "min_replicas or start more replica groups"
            )
        for name in ("timeout", "quorum_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(
                    f"FaultToleranceKwargs({name}={getattr(self, name)!r}) must be a positive "
                    "number of seconds"
                )
        if self.lighthouse is not None and "://" not in self.lighthouse:
            raise ConfigError(
                f"FaultToleranceKwargs(lighthouse={self.lighthouse!r}): give the address with "
                "its scheme, e.g. 'http://127.0.0.1:29510'"
            )

    @classmethod
    def from_config(cls, block: dict[str, Any]) -> FaultToleranceKwargs:
        """From a ``fault_tolerance_config:`` block (the launcher's keys are checked too)."""
        check_config_block(block)
        options = {
            key: block[key]
            for key in ("min_replicas", "lighthouse", "replica_groups", "timeout", "quorum_timeout")
            if block.get(key) is not None
        }
        return cls(**options)


def check_config_block(block: dict[str, Any], where: str = "fault_tolerance_config") -> None:
    """Refuse unknown keys and nonsensical values of a ``fault_tolerance_config`` block."""
    for key in block:
        if key not in CONFIG_KEYS:
            raise ConfigError(
                f"{where}: unknown key '{key}'; the keys are {', '.join(CONFIG_KEYS)}"
            )
    groups = block.get("replica_groups")
    if groups is not None and (not isinstance(groups, int) or groups < 1):
        raise ConfigError(f"{where}: replica_groups must be an integer >= 1, got {groups!r}")
    for key in ("heartbeat_timeout", "join_timeout"):
        value = block.get(key)
        if value is not None and not float(value) > 0:
            raise ConfigError(f"{where}: {key} must be a positive number of seconds, got {value!r}")


def unsupported_layout(distributed_type: str, pipeline_stages: int | None) -> str | None:
    """Why per-step fault tolerance cannot run with this engine or layout, else ``None``.

    Example::

        unsupported_layout("DEEPSPEED", 1)  # -> "fault tolerance does not run with DeepSpeed..."
    """
    kind = distributed_type.upper()
    if kind == "DEEPSPEED":
        return (
            "fault tolerance does not run with DeepSpeed: its engine reduces the gradients "
            "itself (a step cannot be voted on or discarded) and a restarted group cannot copy "
            "ZeRO's state from a peer; run the replica groups with DDP or FSDP2 "
            "(distributed_type FSDP), or turn fault tolerance off"
        )
    if kind == "XLA":
        return (
            "fault tolerance does not run on XLA devices: torchft's process groups work on "
            "CPU and CUDA tensors only; turn fault tolerance off"
        )
    if pipeline_stages is not None and pipeline_stages > 1:
        return (
            f"fault tolerance does not run with pipeline parallelism (pp_size={pipeline_stages}"
            "): its schedule runs backward and the stages' gradients outside the step the "
            "replica groups vote on; use TP or FSDP2 inside a group, or turn fault tolerance "
            "off"
        )
    return None
