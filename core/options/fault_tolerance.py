"""The option objects that turn on fault tolerance over torchft replica groups: per step,
or semi-synchronous (LocalSGD, DiLoCo) with :class:`SemiSyncKwargs`.

Example::

    accelerator = Accelerator(
        fault_tolerance=FaultToleranceKwargs(min_replicas=1, lighthouse="http://host:29510")
    )
"""

from __future__ import annotations

from collections.abc import Callable
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
    "semi_sync",
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "outer_nesterov",
    "fragments",
    "fragment_sync_delay",
    "fragment_update_alpha",
)

#: The keys of the block that make up a :class:`SemiSyncKwargs` (``semi_sync`` is its method).
SEMI_SYNC_KEYS = CONFIG_KEYS[CONFIG_KEYS.index("semi_sync") :]

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
    (
        "ft_semi_sync",
        "semi_sync",
        str,
        "local_sgd or diloco: groups train alone and meet every --ft_sync_every steps",
    ),
    ("ft_sync_every", "sync_every", int, "inner steps between two syncs (semi-synchronous)"),
    ("ft_outer_lr", "outer_lr", float, "DiLoCo's outer learning rate (default 0.7)"),
    ("ft_outer_momentum", "outer_momentum", float, "DiLoCo's outer momentum (default 0.9)"),
    ("ft_fragments", "fragments", int, "streaming DiLoCo: fragments synced in turn (default 1)"),
    (
        "ft_fragment_sync_delay",
        "fragment_sync_delay",
        int,
        "streaming DiLoCo: inner steps a fragment's all-reduce overlaps (default 0)",
    ),
)

#: The semi-synchronous methods.
SEMI_SYNC_METHODS = ("local_sgd", "diloco")


@dataclass
class SemiSyncKwargs(KwargsHandler):
    """Communication-light training over the replica groups (torchft's LocalSGD and DiLoCo):
    each group takes ``sync_every`` optimizer steps alone (the *inner* steps, with the
    script's optimizer), then the groups meet.

    - ``"local_sgd"``: the groups' weights are averaged.
    - ``"diloco"``: the average change of the weights since the last sync (the
      pseudo-gradient) is applied to the last synced weights by an *outer* optimizer, by
      default SGD with Nesterov momentum (``outer_lr``, ``outer_momentum``,
      ``outer_nesterov``; or ``outer_optimizer``, a function from a list of tensors to an
      optimizer). With ``fragments`` > 1 (streaming DiLoCo) the weights are cut into
      that many parts, synced in turn every ``sync_every // fragments`` steps, each part's
      all-reduce overlapping the ``fragment_sync_delay`` inner steps before it is applied;
      ``fragment_update_alpha`` keeps that share of the part's local weights at the sync.

    Example::

        FaultToleranceKwargs(semi_sync=SemiSyncKwargs("diloco", sync_every=32))
    """

    method: str = "diloco"
    sync_every: int = 8
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_optimizer: Callable[[list[Any]], Any] | None = None
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0

    def __post_init__(self) -> None:
        where = f"SemiSyncKwargs(method={self.method!r}, sync_every={self.sync_every!r}"
        if self.method not in SEMI_SYNC_METHODS:
            raise ConfigError(
                f"SemiSyncKwargs(method={self.method!r}): choose 'local_sgd' (average the "
                "weights) or 'diloco' (an outer optimizer on the averaged change)"
            )
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}): {name} must be an integer >= 1, got {value!r}")
        if self.method == "local_sgd" and (
            self.fragments != 1 or self.fragment_sync_delay or self.fragment_update_alpha
        ):
            raise ConfigError(
                f"{where}): fragments, fragment_sync_delay and fragment_update_alpha are "
                "streaming DiLoCo's; use method='diloco'"
            )
        if self.sync_every % self.fragments:
            raise ConfigError(
                f"{where}, fragments={self.fragments}): sync_every must be a multiple of "
                "fragments (each fragment is synced every sync_every steps, one every "
                "sync_every // fragments)"
            )
        delay = self.fragment_sync_delay
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ConfigError(f"{where}): fragment_sync_delay must be an integer >= 0")
        if delay >= self.steps_between_syncs:
            raise ConfigError(
                f"{where}, fragments={self.fragments}, fragment_sync_delay={delay}): a "
                f"fragment's all-reduce must finish before the next sync, {self.steps_between_syncs}"
                " steps later: lower fragment_sync_delay"
            )
        if not 0.0 <= float(self.fragment_update_alpha) <= 1.0:
            raise ConfigError(
                f"{where}): fragment_update_alpha must be between 0 and 1, got "
                f"{self.fragment_update_alpha!r}"
            )
        if self.method == "diloco" and self.outer_optimizer is None and not self.outer_lr > 0:
            raise ConfigError(f"{where}): outer_lr must be positive, got {self.outer_lr!r}")

    @property
    def steps_between_syncs(self) -> int:
        """Inner steps from one sync to the next (of any fragment)."""
        return self.sync_every // self.fragments

    @classmethod
    def from_config(cls, block: dict[str, Any]) -> SemiSyncKwargs | None:
        """From the semi-synchronous keys of a ``fault_tolerance_config`` block (``None``
        when ``semi_sync`` is not set)."""
        method = block.get("semi_sync")
        if not method:
            return None
        options = {
            key: block[key] for key in SEMI_SYNC_KEYS[1:] if key in block and block[key] is not None
        }
        return cls(str(method), **options)


@dataclass
class FaultToleranceKwargs(KwargsHandler):
    """Fault tolerance over replica groups (torchft), per step or semi-synchronous.

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
        semi_sync: a :class:`SemiSyncKwargs`: the groups train alone and meet every
            ``sync_every`` steps (LocalSGD, DiLoCo) instead of averaging every step's
            gradients.
        enabled: ``False`` keeps the option object but trains without fault tolerance.
    """

    min_replicas: int = 1
    lighthouse: str | None = None
    replica_id: str | None = None
    replica_groups: int | None = None
    timeout: float = 60.0
    quorum_timeout: float = 300.0
    semi_sync: SemiSyncKwargs | str | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.semi_sync, str):  # FaultToleranceKwargs(semi_sync="diloco")
            self.semi_sync = SemiSyncKwargs(self.semi_sync)
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
        return cls(**options, semi_sync=SemiSyncKwargs.from_config(block))


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
    semi = [key for key in SEMI_SYNC_KEYS[1:] if block.get(key) is not None]
    if semi and not block.get("semi_sync"):
        raise ConfigError(
            f"{where}: {', '.join(semi)} set without semi_sync: add semi_sync: diloco (or "
            "local_sgd), or leave them out for per-step fault tolerance"
        )
    try:
        SemiSyncKwargs.from_config(block)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


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
