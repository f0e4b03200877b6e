"""The launch configuration: a typed, frozen dataclass with the same YAML keys as
Accelerate's ``default_config.yaml``, so an Accelerate config file works as is.

Example::

    config = load_config("default_config.yaml")
    config = config.replace(num_processes=4)
    save_config(config, "my_config.yaml")
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..options.errors import ConfigError
from ..runtime.env import default_config_file
from .elastic import elastic_settings, validate_elastic

DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8", "bf16-true", "fp16-true")
RDZV_BACKENDS = ("static", "c10d")

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


def _suggest(key: str, candidates: Any) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
            f"{config.distributed_type!r}{_suggest(distributed, DISTRIBUTED_TYPES)}"
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
    _validate_blocks(config, where)
    validate_elastic(dataclasses.replace(config, **changes), where)
    if config.deepspeed_config and config.fsdp_config:
        raise ConfigError(
            f"{where}: deepspeed_config and fsdp_config are both set; DeepSpeed and FSDP cannot "
            "be combined, keep one"
        )
    return dataclasses.replace(config, **changes)


DEEPSPEED_KEYS = (
    "deepspeed_config_file",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_init_flag",
    "zero3_save_16bit_model",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
    "deepspeed_moe_layer_cls_names",
)
DYNAMO_KEYS = (
    "dynamo_backend",
    "dynamo_mode",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)


def _check_keys(block: str, values: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in values:
        if key not in known:
            raise ConfigError(f"{where}: {block}: unknown key '{key}'{_suggest(key, known)}")


def _validate_blocks(config: LaunchConfig, where: str) -> None:
    """Check the nested fsdp_config, deepspeed_config and dynamo_config blocks."""
    if config.fsdp_config:
        from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

        try:
            FullyShardedDataParallelPlugin.from_config(config.fsdp_config)
        except ValueError as error:
            text = str(error)
            raise ConfigError(
                f"{where}: {text if text.startswith('fsdp_config') else 'fsdp_config: ' + text}"
            ) from None
    deepspeed = config.deepspeed_config
    _check_keys("deepspeed_config", deepspeed, DEEPSPEED_KEYS, where)
    stage = deepspeed.get("zero_stage")
    if stage is not None and str(stage) not in ("0", "1", "2", "3"):
        raise ConfigError(
            f"{where}: deepspeed_config: zero_stage must be 0, 1, 2 or 3, got {stage!r}"
        )
    for key in ("offload_optimizer_device", "offload_param_device"):
        device = deepspeed.get(key)
        if device is not None and str(device).lower() not in ("none", "cpu", "nvme"):
            raise ConfigError(
                f"{where}: deepspeed_config: {key} must be none, cpu or nvme, got {device!r}"
            )
    _check_keys("dynamo_config", config.dynamo_config, DYNAMO_KEYS, where)
    if config.parallelism_config:
        _validate_parallelism(config, where)
    from .megatron_config import validate_megatron

    validate_megatron(config, where)
    if config.fault_tolerance_config:
        from ..options.fault_tolerance import check_config_block, unsupported_layout

        check_config_block(config.fault_tolerance_config, f"{where}: fault_tolerance_config")
        stages = (config.parallelism_config or {}).get("parallelism_config_pp_size") or (
            config.megatron_lm_config or {}
        ).get("megatron_lm_pp_degree")
        refused = unsupported_layout(config.distributed_type, stages)
        if refused is not None:
            raise ConfigError(f"{where}: {refused}")
        groups = config.fault_tolerance_config.get("replica_groups")
        if groups and config.num_processes % groups:
            raise ConfigError(
                f"{where}: fault_tolerance_config: replica_groups ({groups}) must divide "
                f"num_processes ({config.num_processes}): every group runs as many processes"
            )


def _validate_parallelism(config: LaunchConfig, where: str) -> None:
    """Check the parallelism_config block against num_processes and DeepSpeed, so a bad
    layout stops the launcher before any process starts."""
    from ..parallel.config import CONFIG_PREFIX, MESH_DIMS, ParallelismConfig

    try:
        parallel = ParallelismConfig.from_config(config.parallelism_config)
    except ConfigError as error:
        raise ConfigError(f"{where}: {_parallelism_message(str(error))}") from None
    given = {dim: getattr(parallel, f"{dim}_size") for dim in MESH_DIMS}
    shown = " x ".join(
        f"{CONFIG_PREFIX}{dim}_size={size}" for dim, size in given.items() if size not in (None, 1)
    )
    try:
        sizes = parallel.resolve(config.num_processes)
    except ConfigError as error:
        if str(error).startswith("ep_size="):  # the sizes fit; the expert split does not
            raise ConfigError(f"{where}: {_parallelism_message(str(error))}") from None
        raise ConfigError(
            f"{where}: parallelism_config: {shown} does not fit num_processes="
            f"{config.num_processes}; the sizes must multiply to num_processes (one of them may "
            "be -1 to take the processes the others leave; with neither data-parallel size "
            "given, dp_shard_size takes them): change the sizes or num_processes"
        ) from None
    deepspeed = config.distributed_type.upper() == "DEEPSPEED" or bool(config.deepspeed_config)
    offending = sizes.beyond_data_parallel()
    if offending and deepspeed:
        keys = ", ".join(f"{CONFIG_PREFIX}{d}_size={sizes.size(d)}" for d in offending)
        using = (
            "distributed_type: DEEPSPEED"
            if config.distributed_type.upper() == "DEEPSPEED"
            else "deepspeed_config"
        )
        raise ConfigError(
            f"{where}: parallelism_config: {keys} cannot be combined with DeepSpeed ({using}), "
            "which shards over all processes itself; drop those sizes (keep at most one of "
            f"{CONFIG_PREFIX}dp_shard_size or {CONFIG_PREFIX}dp_replicate_size), or use FSDP2 "
            "(distributed_type: FSDP) instead of DeepSpeed"
        )


# ParallelismConfig's own messages name its options bare (``tp_size``).
_BARE_PARALLEL_OPTION = re.compile(
    r"(?<!\w)(dp_replicate_size|dp_shard_size|tp_size|cp_size|pp_size|ep_size|ep_plan"
    r"|cp_comm_strategy|cp_backend)"
)


def _parallelism_message(text: str) -> str:
    """ParallelismConfig's message in config-file terms: every option under the
    ``parallelism_config_`` key the user wrote in the file or on the command line."""
    text = _BARE_PARALLEL_OPTION.sub(r"parallelism_config_\1", text)
    text = re.sub(r"\ban (?=parallelism_config_)", "a ", text)  # "an ep_size" -> "a ..."
    return text if text.startswith("parallelism_config:") else f"parallelism_config: {text}"


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
                f"{where}: unknown key '{key}'{_suggest(key, [*_FIELDS, *UNSUPPORTED_KEYS])}"
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
