"""The launch configuration: a typed, frozen dataclass with the same YAML keys as
Accelerate's ``default_config.yaml``, so an Accelerate config file works as is.

Example::

    config = load_config("default_config.yaml")
    config = config.replace(num_processes=4)
    save_config(config, "my_config.yaml")
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..options.errors import ConfigError
from ..runtime.env import default_config_file
from .config_blocks import suggest, validate_blocks
from .elastic import elastic_settings, validate_elastic

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8", "bf16-true", "fp16-true")
RDZV_BACKENDS = ("static", "c10d")
WORKER_STARTS = ("auto", "fork", "exec")

# Accelerate keys for hardware slipstream does not drive; accepted only at their defaults.
UNSUPPORTED_KEYS: dict[str, Any] = {
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "tpu_name": None,
    "tpu_zone": None,
    "commands": None,
    "command_file": None,
    "ipex_config": {},
    "mpirun_config": {},
    "enable_cpu_affinity": False,
    "fp8_config": {},
}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``slipstream launch`` needs; field names are the YAML keys."""

    compute_environment: str = "LOCAL_MACHINE"
    distributed_type: str = "NO"
    mixed_precision: str = "no"
    use_cpu: bool = False
    debug: bool = False
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str = "c10d"
    #: torchrun's extra rendezvous options, ``key=value,key=value`` (Accelerate's key).
    rdzv_conf: str = ""
    #: Elastic sizes: the fewest machines the job runs on (``--nnodes MIN:MAX``; MAX is
    #: ``num_machines``). ``None``: always ``num_machines``.
    min_machines: int | None = None
    #: What an elastic job keeps when its size changes: ``global`` (the global batch of
    #: ``num_machines`` machines; accumulation adjusts) or ``per_process``.
    elastic_batch: str = "global"
    same_network: bool = True
    main_training_function: str = "main"
    downcast_bf16: str = "no"
    gpu_ids: str = "all"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    #: On a preemption signal, save a checkpoint at the next step and exit for requeue.
    save_on_preemption: bool = False
    #: The signals that mean "preempted" (comma-separated names).
    preemption_signals: str = "SIGTERM,SIGUSR1"
    #: Seconds stopping workers get (after SIGTERM) before they are killed.
    termination_grace_period: float = 30.0
    #: Seconds without progress before every process reports what it is doing and the job
    #: ends (exit code 86); ``None``: just under the collective timeout; 0: off.
    hang_timeout: float | None = None
    #: Show torch's elastic agent's own log lines (the launcher hides them otherwise).
    verbose: bool = False
    #: How workers start: ``fork`` from the launcher, which imported torch once (about two
    #: seconds of CPU less per worker), ``exec`` a fresh interpreter each (as torchrun), or
    #: ``auto``: fork for CPU jobs, exec for GPU jobs.
    worker_start: str = "auto"
    gradient_accumulation_steps: int = 1
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    #: Accelerate's ``parallelism_config:`` block (``parallelism_config_tp_size`` ...); empty
    #: means plain data parallelism. See :class:`slipstream.ParallelismConfig`.
    parallelism_config: dict[str, Any] = field(default_factory=dict)
    #: Accelerate's ``megatron_lm_config:`` block, run on tensor/pipeline parallelism with
    #: FSDP2 (see docs/megatron.md); an alternative to ``parallelism_config``.
    megatron_lm_config: dict[str, Any] = field(default_factory=dict)
    #: Per-step fault tolerance with torchft (``replica_groups``, ``min_replicas``,
    #: ``lighthouse``, ``heartbeat_timeout`` ...); empty means off. See
    #: docs/fault-tolerance.md.
    fault_tolerance_config: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> LaunchConfig:
        """A copy with ``changes`` applied (and validated)."""
        return validate(dataclasses.replace(self, **changes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def parallel_layout(self) -> str | None:
        """The mesh the ``parallelism_config`` block gives, e.g. ``"dp_shard=2 x tp=2"``
        (``None`` without a block). Call on a validated config."""
        from ..parallel.config import ParallelismConfig
        from .megatron_config import megatron_in_use, megatron_layout

        if megatron_in_use(self) and not self.parallelism_config:
            return megatron_layout(self).resolve(self.num_processes).describe()
        if not self.parallelism_config:
            return None
        block = ParallelismConfig.from_config(self.parallelism_config)
        return block.resolve(self.num_processes).describe()

    def worker_settings(self) -> dict[str, Any]:
        """What the launched processes' Accelerator reads (via one environment variable)."""
        return {
            "distributed_type": self.distributed_type,
            "mixed_precision": self.mixed_precision,
            "use_cpu": self.use_cpu,
            "debug": self.debug,
            "downcast_bf16": self.downcast_bf16,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "save_on_preemption": self.save_on_preemption,
            "preemption_signals": self.preemption_signals,
            "hang_timeout": self.hang_timeout,
            "dynamo_config": self.dynamo_config,
            "deepspeed_config": self.deepspeed_config,
            "fsdp_config": self.fsdp_config,
            "parallelism_config": self.parallelism_config,
            "megatron_lm_config": self.megatron_lm_config,
            "elastic": elastic_settings(self),
            "fault_tolerance_config": self.fault_tolerance_config,
        }


_FIELDS = {f.name: f for f in dataclasses.fields(LaunchConfig)}


def _coerce(key: str, value: Any, annotation: str, where: str) -> Any:
    """Check (and gently convert) one value against its field's annotation."""
    if value is None and "None" in annotation:
        return None
    if annotation.startswith("bool"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        expected = "true or false"
    elif annotation.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdecimal():
            return int(value)
        expected = "an integer"
    elif annotation.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        expected = "a number"
    elif annotation.startswith("dict"):
        if isinstance(value, dict):
            return value
        if value is None:
            return {}
        expected = "a mapping"
    else:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
        expected = "a string"
    raise ConfigError(f"{where}: key '{key}' must be {expected}, got {value!r}")


def validate(config: LaunchConfig, where: str = "configuration") -> LaunchConfig:
    """Check cross-field rules; returns the config (normalised) or raises ConfigError."""
    changes: dict[str, Any] = {}
    distributed = config.distributed_type.upper()
    if distributed not in DISTRIBUTED_TYPES:
        raise ConfigError(
            f"{where}: distributed_type must be one of {', '.join(DISTRIBUTED_TYPES)}, got "
            f"{config.distributed_type!r}{suggest(distributed, DISTRIBUTED_TYPES)}"
        )
    changes["distributed_type"] = distributed
    if distributed == "XLA" and config.use_cpu:
        raise ConfigError(
            f"{where}: distributed_type: XLA (--tpu) runs on the XLA device and use_cpu (--cpu) "
            "on the CPU: pass one of them (XLA on the CPU, for tests: --tpu with PJRT_DEVICE=CPU)"
        )
    from ..precision import canonical_mode

    try:
        changes["mixed_precision"] = canonical_mode(config.mixed_precision)
    except ValueError:
        raise ConfigError(
            f"{where}: mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got "
            f"{config.mixed_precision!r}"
        ) from None
    if config.rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(
            f"{where}: rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got "
            f"{config.rdzv_backend!r}"
        )
    if config.num_processes < 1:
        raise ConfigError(f"{where}: num_processes must be at least 1, got {config.num_processes}")
    if config.num_machines < 1:
        raise ConfigError(f"{where}: num_machines must be at least 1, got {config.num_machines}")
    if not 0 <= config.machine_rank < config.num_machines:
        raise ConfigError(
            f"{where}: machine_rank must be between 0 and num_machines-1 "
            f"({config.num_machines - 1}), got {config.machine_rank}"
        )
    if config.num_processes % config.num_machines:
        raise ConfigError(
            f"{where}: num_processes ({config.num_processes}) is the total over all machines "
            f"and must be divisible by num_machines ({config.num_machines})"
        )
    if config.num_machines > 1 and not config.main_process_ip:
        raise ConfigError(
            f"{where}: num_machines={config.num_machines} needs main_process_ip (the address "
            "of the machine with machine_rank 0)"
        )
    if config.main_process_port is not None and not 0 < config.main_process_port < 65536:
        raise ConfigError(
            f"{where}: main_process_port must be a TCP port (1-65535), got "
            f"{config.main_process_port}"
        )
    if not config.monitor_interval > 0:
        raise ConfigError(
            f"{where}: monitor_interval must be a positive number of seconds, got "
            f"{config.monitor_interval}"
        )
    if config.worker_start not in WORKER_STARTS:
        raise ConfigError(
            f"{where}: worker_start must be one of {', '.join(WORKER_STARTS)}, got "
            f"{config.worker_start!r}"
        )
    if config.termination_grace_period < 0:
        raise ConfigError(
            f"{where}: termination_grace_period must be >= 0 seconds, got "
            f"{config.termination_grace_period}"
        )
    from ..runtime.preemption import signal_numbers

    try:
        signal_numbers(config.preemption_signals)
    except ValueError as error:
        raise ConfigError(f"{where}: preemption_signals: {error}") from None
    if config.hang_timeout is not None and config.hang_timeout < 0:
        raise ConfigError(
            f"{where}: hang_timeout must be >= 0 seconds (0 turns the hang report off), got "
            f"{config.hang_timeout}"
        )
    if config.max_restarts < 0:
        raise ConfigError(f"{where}: max_restarts must be >= 0, got {config.max_restarts}")
    if config.gradient_accumulation_steps < 1:
        raise ConfigError(
            f"{where}: gradient_accumulation_steps must be >= 1, got "
            f"{config.gradient_accumulation_steps}"
        )
    validate_blocks(config, where)
    validate_elastic(dataclasses.replace(config, **changes), where)
    if config.deepspeed_config and config.fsdp_config:
        raise ConfigError(
            f"{where}: deepspeed_config and fsdp_config are both set; DeepSpeed and FSDP cannot "
            "be combined, keep one"
        )
    return dataclasses.replace(config, **changes)


def config_from_dict(
    values: Mapping[str, Any], where: str = "configuration"
) -> tuple[LaunchConfig, list[str]]:
    """Build a validated LaunchConfig; also returns notes about ignored Accelerate keys."""
    notes: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key in _FIELDS:
            kwargs[key] = _coerce(key, value, str(_FIELDS[key].type), where)
        elif key in UNSUPPORTED_KEYS:
            if value not in (UNSUPPORTED_KEYS[key], None, [], {}, False):
                notes.append(
                    f"{where}: key '{key}' is an Accelerate option slipstream does not support "
                    "yet; it is ignored"
                )
        else:
            raise ConfigError(
                f"{where}: unknown key '{key}'{suggest(key, [*_FIELDS, *UNSUPPORTED_KEYS])}"
            )
    return validate(LaunchConfig(**kwargs), where), notes


def read_config_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw key/value mapping of a YAML (or JSON) config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value")
    return values


def load_config(path: str | os.PathLike[str]) -> tuple[LaunchConfig, list[str]]:
    """Read and validate a config file; also returns notes about ignored Accelerate keys."""
    return config_from_dict(read_config_values(path), where=str(path))


def save_config(config: LaunchConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` as YAML (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=True))
    return path


def gpu_count() -> int:
    """CUDA devices on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def write_basic_config(
    mixed_precision: str = "no", save_location: str | Path | None = None
) -> Path | bool:
    """Write a config that uses every available device; False if the file already exists.

    Example::

        from slipstream.utils import write_basic_config
        write_basic_config(mixed_precision="fp16")
    """
    path = Path(save_location) if save_location is not None else default_config_file()
    if path.exists():
        return False
    gpus = gpu_count()
    values: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "num_processes": max(1, gpus),
        "use_cpu": gpus == 0,
        "mixed_precision": mixed_precision,
    }
    config, _ = config_from_dict(values, where="write_basic_config")
    return save_config(config, path)
