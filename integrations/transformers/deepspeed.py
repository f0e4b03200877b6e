"""DeepSpeed through transformers' Trainer, on slipstream's DeepSpeed strategy.

transformers drives DeepSpeed itself: ``TrainingArguments(deepspeed=...)`` makes an
``HfTrainerDeepSpeedConfig`` (the JSON with its ``"auto"`` values filled in from the
arguments) and hands it over inside Accelerate's ``DeepSpeedPlugin``; the Trainer's
``deepspeed_init`` finishes it before ``prepare()`` (total steps, bucket sizes from the
model's hidden size) and chooses the optimizer and scheduler (Accelerate's ``DummyOptim`` /
``DummyScheduler`` when the JSON defines them); the engine writes and reads its own
checkpoints (``save_checkpoint`` / ``deepspeed_load_checkpoint``). Here slipstream's
``DeepSpeedPlugin`` holds that same config object, so every value the Trainer fills in
reaches the engine slipstream's strategy builds at ``prepare()``.
"""

from __future__ import annotations

from typing import Any

from .errors import TrainerConfigurationError


def _refuse_unsupported(config: dict[str, Any]) -> None:
    autotp = (config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if autotp not in (None, 1, "auto"):
        raise TrainerConfigurationError(
            f"the DeepSpeed config sets tensor_parallel.autotp_size={autotp} (DeepSpeed's "
            "AutoTP), which slipstream does not run: remove it, or use tensor parallelism with "
            "accelerator_options={'parallelism_config': ParallelismConfig(tp_size=...)} and "
            "fsdp=... instead of DeepSpeed"
        )


def deepspeed_plugin(trainer: Any) -> Any:
    """slipstream's ``DeepSpeedPlugin`` for the Trainer's arguments, or None without
    DeepSpeed. It holds the Trainer's own config object; values the JSON leaves out fall
    back to the arguments (``max_grad_norm``, ``gradient_accumulation_steps``)."""
    args = trainer.args
    accelerates = getattr(args, "deepspeed_plugin", None)
    if accelerates is None:
        return None
    from slipstream.utils import DeepSpeedPlugin

    config = getattr(args, "hf_deepspeed_config", None) or accelerates.hf_ds_config
    _refuse_unsupported(config.config)
    return DeepSpeedPlugin(
        hf_ds_config=config,
        gradient_clipping=args.max_grad_norm,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        zero3_init_flag=bool(getattr(accelerates, "zero3_init_flag", False)),
    )


def fill_trainer_values(trainer: Any, accelerator: Any) -> None:
    """Give DeepSpeed chosen without ``TrainingArguments(deepspeed=...)`` (by the launcher's
    config or ``accelerator_options``) the Trainer's kind of config
    (``HfTrainerDeepSpeedConfig``, which the Trainer's ``deepspeed_init`` finishes), its
    ``"auto"`` values taken from the arguments, as transformers'
    ``propagate_args_to_deepspeed`` does for ``accelerate launch --use_deepspeed``."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or hasattr(plugin.hf_ds_config, "trainer_config_finalize"):
        return
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = trainer.args
    filled = HfTrainerDeepSpeedConfig(plugin.json_config())
    _refuse_unsupported(filled.config)
    filled.config.setdefault("steps_per_print", float("inf"))  # as Accelerate's plugin: quiet
    filled.trainer_config_process(args)
    plugin.hf_ds_config = filled
    if plugin.gradient_clipping is None:
        plugin.gradient_clipping = args.max_grad_norm
    # transformers finds the config through a weak reference (is_deepspeed_zero3_enabled):
    # the arguments keep it alive, as they keep the one they made.
    args.hf_deepspeed_config = filled


def check_arguments(trainer: Any, plugin: Any) -> None:
    """The argument combinations transformers refuses under DeepSpeed."""
    args = trainer.args
    if args.save_only_model and args.load_best_model_at_end:
        raise TrainerConfigurationError(
            "DeepSpeed cannot combine save_only_model with load_best_model_at_end: the best "
            "checkpoint would have no engine state to resume from"
        )
    if args.auto_find_batch_size and plugin.zero_stage == 3:
        raise TrainerConfigurationError(
            "auto_find_batch_size does not work with DeepSpeed ZeRO-3 (as in transformers): "
            "use ZeRO-2, or set per_device_train_batch_size"
        )
