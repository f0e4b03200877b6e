"""Checks of the launch configuration's nested blocks (``fsdp_config``, ``deepspeed_config``,
``dynamo_config``, ``parallelism_config``, ``fault_tolerance_config``): a bad block stops the
launcher before any process starts, with the key to change.

Example::

    validate_blocks(LaunchConfig(deepspeed_config={"zero_stage": 4}), "config.yaml")
    # ConfigError: config.yaml: deepspeed_config: zero_stage must be 0, 1, 2 or 3, got 4
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from ..options.errors import ConfigError

#: The functions below take a :class:`~slipstream.launcher.config.LaunchConfig` (typed
#: ``Any``: that module imports this one).
LaunchConfig = Any


def suggest(key: str, candidates: Any) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate, or nothing."""
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
            raise ConfigError(f"{where}: {block}: unknown key '{key}'{suggest(key, known)}")


def validate_blocks(config: LaunchConfig, where: str) -> None:
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
