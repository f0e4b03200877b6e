"""slipstream's Accelerator, built from a Trainer's ``TrainingArguments`` as
``transformers.Trainer.create_accelerator_and_postprocess`` builds Accelerate's.

What maps to what:

* gradient accumulation stays the Trainer's own: the Accelerator gets
  ``GradientAccumulationPlugin(num_steps=1)`` plus ``accelerator_config.gradient_accumulation_kwargs``
  (``sync_each_batch``), and the Trainer sets ``gradient_state._set_sync_gradients`` itself;
* ``accelerator_config`` (``split_batches``, ``dispatch_batches``, ``even_batches``,
  ``use_seedable_sampler``, ``non_blocking``) and ``data_seed`` -> ``DataLoaderConfiguration``;
* ``ddp_find_unused_parameters`` / ``ddp_bucket_cap_mb`` / ``ddp_broadcast_buffers`` /
  ``ddp_static_graph``, ``mixed_precision``, ``torch_compile*`` and ``parallelism_config``:
  the Trainer's own ``_build_accelerator_args`` (its Accelerate objects are converted by the
  Accelerator);
* ``fsdp`` / ``fsdp_config`` -> slipstream's ``FullyShardedDataParallelPlugin`` (FSDP2);
* ``accelerator_options`` (the slipstream Trainer's keyword) -> any further Accelerator
  argument: ``parallelism_config`` with tp/pp/ep sizes, ``fault_tolerance``,
  ``hang_timeout``, ``callbacks``...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Accelerator arguments the Trainer derives from TrainingArguments; accelerator_options may
#: not set them (they would contradict the arguments the Trainer itself follows).
DERIVED = ("gradient_accumulation_plugin", "gradient_accumulation_steps", "dataloader_config")


class TrainerConfigurationError(ValueError):
    """The Trainer's arguments ask for something slipstream's Trainer does not do."""


def _accumulation_plugin(trainer: Any) -> Any:
    from slipstream.utils import GradientAccumulationPlugin

    args = trainer.args
    options = dict(args.accelerator_config.gradient_accumulation_kwargs or {})
    if "num_steps" in options:
        if args.gradient_accumulation_steps > 1:
            raise TrainerConfigurationError(
                "accelerator_config.gradient_accumulation_kwargs sets num_steps and "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} is set too: "
                "keep one of them"
            )
        args.gradient_accumulation_steps = int(options["num_steps"])
    # The Trainer divides losses and steps the optimizer itself: one micro-batch per step here.
    options["num_steps"] = 1
    return GradientAccumulationPlugin(**options)


def _dataloader_config(trainer: Any) -> Any:
    from slipstream.utils import DataLoaderConfiguration

    args, settings = trainer.args, trainer.args.accelerator_config
    return DataLoaderConfiguration(
        split_batches=settings.split_batches,
        dispatch_batches=settings.dispatch_batches,
        even_batches=settings.even_batches,
        use_seedable_sampler=settings.use_seedable_sampler,
        non_blocking=settings.non_blocking,
        data_seed=args.data_seed,
    )


def _fsdp_plugin(trainer: Any) -> Any:
    settings = trainer.args.fsdp_plugin_args
    if settings is None:
        return None
    from slipstream.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin.from_config(settings)


def accelerator_arguments(trainer: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of slipstream's Accelerator for ``trainer``."""
    if trainer.args.deepspeed_plugin is not None:
        raise TrainerConfigurationError(
            "TrainingArguments(deepspeed=...) is not supported by slipstream's Trainer: "
            "transformers drives DeepSpeed through Accelerate's DeepSpeedPlugin "
            "(deepspeed_init and its HfTrainerDeepSpeedConfig). Shard with fsdp=... (FSDP2), "
            "or run DeepSpeed with slipstream's Accelerator in your own loop"
        )
    clashing = sorted(set(options) & set(DERIVED))
    if clashing:
        raise TrainerConfigurationError(
            f"accelerator_options cannot set {clashing}: the Trainer derives them from "
            "TrainingArguments (gradient_accumulation_steps, accelerator_config, data_seed)"
        )
    if not callable(getattr(trainer, "_build_accelerator_args", None)):
        import transformers

        raise TrainerConfigurationError(
            f"slipstream's Trainer builds on transformers' Trainer._build_accelerator_args, "
            f"which transformers {transformers.__version__} lacks: upgrade transformers "
            "(tested with 5.24)"
        )
    arguments = trainer._build_accelerator_args(
        dataloader_config=_dataloader_config(trainer),
        fsdp_plugin=_fsdp_plugin(trainer),
        gradient_accumulation_plugin=_accumulation_plugin(trainer),
    )
    arguments.pop("deepspeed_plugin", None)
    arguments.update(options)
    return arguments


def build_accelerator(trainer: Any, options: Mapping[str, Any]) -> Any:
    """slipstream's Accelerator for ``trainer`` (see the module doc for what maps to what).

    Like transformers, which resets Accelerate's state for every ``TrainingArguments``, a
    Trainer lays the processes out anew: a layout (mesh) an earlier Trainer of the process
    arranged is dropped first (the process group stays), so the next Trainer may ask for
    another one, or none."""
    from slipstream import AcceleratorState
    from slipstream.runtime.state import current_state, has_current_state

    arguments = accelerator_arguments(trainer, options)
    if has_current_state() and current_state().mesh is not None:
        AcceleratorState._reset_state(reset_partial_state=True)
    from slipstream import Accelerator

    return Accelerator(**arguments)
