"""The launch configuration's ``megatron_lm_config`` block (Accelerate's keys,
``megatron_lm_tp_degree`` ...), checked before any process starts: its keys, its values and
the layout it gives against ``num_processes``; ``slipstream launch``'s ``--megatron_lm_*``
flags (Accelerate's names, one per key of the block) and the launcher's note naming the keys
that have no equivalent.

Example::

    validate_megatron(config, "accelerate_cfg.yaml")   # raises ConfigError naming the key
    megatron_notes(config)   # ['megatron_lm_config: megatron_lm_hidden_dropout ... ignored ...']
"""

from __future__ import annotations

from typing import Any

from ..options.errors import ConfigError
from ..parallel.config import ParallelismConfig

#: A ``slipstream.launcher.config.LaunchConfig`` (not imported: that module imports this one).
LaunchConfig = Any

PREFIX = "megatron_lm_"
#: ``--use_megatron_lm`` (argparse options): Accelerate needs the switch before it reads the
#: flags; here the block or any flag is enough.
SWITCH: dict[str, Any] = {
    "action": "store_const",
    "const": True,
    "help": "train with Megatron-LM's layout options (the flags below are enough alone)",
}
_IGNORED = "ignored (no slipstream equivalent; named in a note)"
#: ``slipstream launch``'s Megatron-LM flags, Accelerate's names, each filling the block's key
#: of the same name: (flag, key, type, help). Truth values are text (true/false), read as the
#: file's are; Accelerate's ``type=bool`` flags included (there "false" meant true).
LAUNCH_FLAGS: tuple[tuple[str, str, Any, str], ...] = tuple(
    (PREFIX + name, PREFIX + name, kind, text)
    for name, kind, text in (
        ("tp_degree", int, "tensor-parallel processes (tp_size; the model's plan)"),
        ("pp_degree", int, "pipeline stages (pp_size, 1F1B schedule)"),
        (
            "num_micro_batches",
            int,
            "micro-batches per batch (pp_microbatches); each prepared batch holds this many "
            "DataLoader batches",
        ),
        ("sequence_parallelism", str, "true: shard activations along the sequence (tp > 1)"),
        ("recompute_activations", str, "true: recompute the model's blocks in backward"),
        (
            "use_distributed_optimizer",
            str,
            "true: shard parameters, gradients and optimizer state (FSDP2) over the "
            "data-parallel processes; false: replicas",
        ),
        ("gradient_clipping", float, "clip the global gradient norm to this (default 1.0; 0: off)"),
        ("context_parallel_size", int, "context-parallel processes (cp_size; CUDA)"),
        ("expert_model_parallel_size", int, "expert-parallel processes (ep_size)"),
        ("use_custom_fsdp", str, "true: as use_distributed_optimizer"),
        ("no_load_optim", str, _IGNORED),
        ("no_save_optim", str, _IGNORED),
        ("eod_mask_loss", str, _IGNORED),
        ("overlap_cpu_optimizer_d2h_h2d", str, _IGNORED),
        ("optimizer_cpu_offload", str, _IGNORED),
        ("use_precision_aware_optimizer", str, _IGNORED),
        ("decoder_last_pipeline_num_layers", int, _IGNORED),
        ("recompute_granularity", str, _IGNORED),
        ("recompute_method", str, _IGNORED),
        ("recompute_num_layers", int, _IGNORED),
        ("attention_backend", str, _IGNORED),
        ("attention_dropout", float, _IGNORED),
        ("hidden_dropout", float, _IGNORED),
        ("attention_softmax_in_fp32", str, _IGNORED),
        ("expert_tensor_parallel_size", int, _IGNORED),
        ("calculate_per_token_loss", str, _IGNORED),
        ("use_rotary_position_embeddings", str, _IGNORED),
    )
)


def megatron_in_use(config: LaunchConfig) -> bool:
    return bool(config.megatron_lm_config) or config.distributed_type.upper() == "MEGATRON_LM"


def megatron_layout(config: LaunchConfig) -> ParallelismConfig:
    """The ParallelismConfig the ``megatron_lm_config`` block describes."""
    from ..strategies.megatron_plugin import MegatronLMPlugin

    return MegatronLMPlugin.from_config(config.megatron_lm_config).to_parallelism_config()


def validate_megatron(config: LaunchConfig, where: str) -> None:
    """Refuse a bad block, a second layout or DeepSpeed, and sizes that do not fit."""
    if not megatron_in_use(config):
        return
    try:
        layout = megatron_layout(config)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    if config.parallelism_config:
        raise ConfigError(
            f"{where}: megatron_lm_config and parallelism_config both describe the layout; keep "
            "one (megatron_lm_tp_degree is parallelism_config_tp_size, megatron_lm_pp_degree is "
            "parallelism_config_pp_size; see docs/megatron.md)"
        )
    if config.deepspeed_config or config.distributed_type.upper() == "DEEPSPEED":
        raise ConfigError(
            f"{where}: megatron_lm_config cannot be combined with DeepSpeed: Megatron-LM "
            "layouts run on tensor and pipeline parallelism with FSDP2; drop deepspeed_config"
        )
    try:
        layout.resolve(config.num_processes)
    except ConfigError:
        block = config.megatron_lm_config
        degrees = {
            key: block[f"megatron_lm_{key}"]
            for key in ("tp_degree", "pp_degree", "context_parallel_size")
            if f"megatron_lm_{key}" in block
        }
        shown = " x ".join(f"megatron_lm_{key}={value}" for key, value in degrees.items())
        raise ConfigError(
            f"{where}: megatron_lm_config: {shown or 'the degrees'} do not divide num_processes="
            f"{config.num_processes}; the data-parallel size is num_processes / (tp_degree x "
            "pp_degree x context_parallel_size): change the degrees or num_processes"
        ) from None


def megatron_notes(config: LaunchConfig) -> list[str]:
    """One line naming the block's keys that have no slipstream equivalent (set away from
    Accelerate's defaults), for the launcher to print before anything starts; the main
    process warns about them too. Call on a validated config."""
    if not megatron_in_use(config):
        return []
    from ..strategies.megatron_plugin import MegatronLMPlugin

    ignored = MegatronLMPlugin.from_config(config.megatron_lm_config).ignored_options()
    if not ignored:
        return []
    return [
        f"megatron_lm_config: {', '.join(PREFIX + name for name in ignored)} "
        f"{'has' if len(ignored) == 1 else 'have'} no slipstream equivalent and "
        f"{'is' if len(ignored) == 1 else 'are'} ignored (they steer Megatron-LM's own trainer, "
        "models, scheduler or logging; see docs/megatron.md)"
    ]
