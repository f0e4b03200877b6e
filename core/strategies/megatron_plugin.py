"""Accelerate's ``MegatronLMPlugin`` and ``megatron_lm_config`` block, run on slipstream's own
tensor, sequence and pipeline parallelism with FSDP2 (no Megatron-LM needed).

The plugin keeps Accelerate's signature; what it asks for becomes a
:class:`~slipstream.ParallelismConfig` plus FSDP2 options:

=============================  =====================================================
``tp_degree``                  ``tp_size`` (the model's tensor-parallel plan)
``pp_degree``                  ``pp_size`` (1F1B schedule, Megatron's default)
``num_micro_batches``          ``pp_microbatches``; each prepared batch holds this many
                               DataLoader batches, as in Accelerate's Megatron path
``sequence_parallelism``       ``sequence_parallel``
``context_parallel_size``      ``cp_size``
``expert_model_parallel_size`` ``ep_size``
``recompute_activations``      activation checkpointing of the model's blocks
``use_distributed_optimizer``  FSDP2 sharding over the data-parallel processes
                               (``dp_shard``; without it they are replicas)
``gradient_clipping``          the global gradient norm is clipped to it before every
                               optimizer step (0 turns it off)
=============================  =====================================================

Options that only steer Megatron-LM's own trainer, models or datasets have no equivalent:
set away from Accelerate's defaults they are named in one warning; those that would change
what is computed (a custom loss, batch or train-step function, Megatron's indexed datasets)
are refused. See docs/megatron.md.

Example::

    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2)
    accelerator = Accelerator(megatron_lm_plugin=plugin)   # 4 processes: pp 2 x tp 2
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..options.errors import ConfigError
from ..parallel.config import ParallelismConfig

CONFIG_PREFIX = "megatron_lm_"

#: Options mapped onto slipstream's layout (see the module's table).
MAPPED = (
    "tp_degree",
    "pp_degree",
    "num_micro_batches",
    "sequence_parallelism",
    "recompute_activations",
    "use_distributed_optimizer",
    "use_custom_fsdp",
    "gradient_clipping",
    "context_parallel_size",
    "expert_model_parallel_size",
)
#: Options that would change what is computed if ignored: refused when set.
REFUSED = {
    "megatron_dataset_flag": "Megatron-LM's indexed datasets are not read; pass a DataLoader",
    "custom_train_step_class": "the training step is your script's (forward_backward)",
    "custom_train_step_kwargs": "the training step is your script's (forward_backward)",
    "custom_model_provider_function": "prepare() takes your model as it is",
    "custom_prepare_model_function": "prepare() takes your model as it is",
    "custom_megatron_datasets_provider_function": "pass DataLoaders to prepare()",
    "custom_get_batch_function": "batches are the DataLoader's",
    "custom_loss_function": "compute the loss in your script (forward_backward(loss_fn=...))",
}
#: Accelerate's defaults of the options without an equivalent: other values are named in a
#: warning (they steer Megatron-LM's own trainer, models, scheduler or logging).
IGNORED_DEFAULTS: dict[str, Any] = {
    "overlap_cpu_optimizer_d2h_h2d": False,
    "no_load_optim": False,
    "eod_mask_loss": False,
    "no_save_optim": False,
    "optimizer_cpu_offload": False,
    "use_precision_aware_optimizer": False,
    "decoder_last_pipeline_num_layers": None,
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "attention_backend": True,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "expert_tensor_parallel_size": 1,
    "calculate_per_token_loss": True,
    "use_rotary_position_embeddings": True,
    "pipeline_model_parallel_split_rank": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "is_train_batch_min": True,
    "train_iters": None,
    "train_samples": None,
    "weight_decay_incr_style": "constant",
    "start_weight_decay": None,
    "end_weight_decay": None,
    "lr_decay_style": "linear",
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_warmup_iters": None,
    "lr_warmup_samples": None,
    "lr_warmup_fraction": None,
    "min_lr": 0,
    "consumed_samples": None,
    "no_wd_decay_cond": None,
    "scale_lr_cond": None,
    "lr_mult": 1.0,
    "seq_length": None,
    "encoder_seq_length": None,
    "decoder_seq_length": None,
    "tensorboard_dir": None,
    "set_all_logging_options": False,
    "eval_iters": 100,
    "eval_interval": 1000,
    "return_logits": False,
    "other_megatron_args": None,
}


class MegatronLMConfigError(ConfigError):
    """A Megatron-LM option slipstream cannot honour (or a bad value)."""


@dataclass
class MegatronLMPlugin:
    """Accelerate's Megatron-LM options (same names, order and defaults), run on
    slipstream's tensor/sequence/pipeline parallelism with FSDP2; see the module's table.

    Unset options take Accelerate's defaults: degrees 1, one micro-batch, clipping at 1.0,
    no recomputation, replicated data parallelism. ``context_parallel_size`` left unset is
    1 (Accelerate's environment default of 2 is not followed).
    """

    tp_degree: int | None = None
    pp_degree: int | None = None
    use_custom_fsdp: bool | None = None
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    no_load_optim: bool | None = None
    eod_mask_loss: bool | None = None
    no_save_optim: bool | None = None
    optimizer_cpu_offload: bool | None = None
    use_precision_aware_optimizer: bool | None = None
    decoder_last_pipeline_num_layers: int | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_backend: bool | None = None
    expert_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    attention_dropout: float | None = None
    hidden_dropout: float | None = None
    attention_softmax_in_fp32: bool | None = None
    expert_tensor_parallel_size: int | None = None
    calculate_per_token_loss: bool | None = None
    use_rotary_position_embeddings: bool | None = None
    num_micro_batches: int | None = None
    gradient_clipping: float | None = None
    sequence_parallelism: bool | None = None
    recompute_activations: bool | None = None
    use_distributed_optimizer: bool | None = None
    pipeline_model_parallel_split_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    is_train_batch_min: bool | str = True
    train_iters: int | None = None
    train_samples: int | None = None
    weight_decay_incr_style: str = "constant"
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_warmup_fraction: float | None = None
    min_lr: float = 0
    consumed_samples: list[int] | None = None
    no_wd_decay_cond: Callable[..., Any] | None = None
    scale_lr_cond: Callable[..., Any] | None = None
    lr_mult: float = 1.0
    megatron_dataset_flag: bool = False
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    tensorboard_dir: str | None = None
    set_all_logging_options: bool = False
    eval_iters: int = 100
    eval_interval: int = 1000
    return_logits: bool = False
    custom_train_step_class: Any | None = None
    custom_train_step_kwargs: dict[str, Any] | None = None
    custom_model_provider_function: Callable[..., Any] | None = None
    custom_prepare_model_function: Callable[..., Any] | None = None
    custom_megatron_datasets_provider_function: Callable[..., Any] | None = None
    custom_get_batch_function: Callable[..., Any] | None = None
    custom_loss_function: Callable[..., Any] | None = None
    other_megatron_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in (
            "tp_degree",
            "pp_degree",
            "num_micro_batches",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, 1)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MegatronLMConfigError(
                    f"MegatronLMPlugin: {name} must be a positive integer, got {value!r}"
                )
        if self.gradient_clipping is None:
            self.gradient_clipping = 1.0
        if isinstance(self.gradient_clipping, bool) or not isinstance(
            self.gradient_clipping, (int, float)
        ):
            raise MegatronLMConfigError(
                "MegatronLMPlugin: gradient_clipping must be a number (0 turns clipping off), "
                f"got {self.gradient_clipping!r}"
            )
        if self.gradient_clipping < 0:
            raise MegatronLMConfigError(
                "MegatronLMPlugin: gradient_clipping must be >= 0 (0 turns clipping off), got "
                f"{self.gradient_clipping}"
            )
        self.gradient_clipping = float(self.gradient_clipping)
        for name in (
            "sequence_parallelism",
            "recompute_activations",
            "use_distributed_optimizer",
            "use_custom_fsdp",
        ):
            setattr(self, name, bool(getattr(self, name)))
        refused = [
            f"{name} ({why})"
            for name, why in REFUSED.items()
            if getattr(self, name) not in (None, False, {})
        ]
        if refused:
            raise MegatronLMConfigError(
                "MegatronLMPlugin: slipstream runs Megatron-LM layouts on your own model and "
                "training loop, so these options would be silently different; remove them: "
                + "; ".join(refused)
            )

    # -- what has no equivalent -----------------------------------------------------------
    def ignored_options(self) -> list[str]:
        """The options set away from Accelerate's defaults that slipstream does not use."""
        return [
            name
            for name, default in IGNORED_DEFAULTS.items()
            if getattr(self, name) is not None
            and getattr(self, name) != default
            and getattr(self, name) != {}
        ]

    def ignored_message(self) -> str | None:
        names = self.ignored_options()
        if not names:
            return None
        return (
            "MegatronLMPlugin: these Megatron-LM options have no slipstream equivalent and are "
            f"ignored: {', '.join(names)} (they steer Megatron-LM's own trainer, models, "
            "scheduler or logging; your model's definition, optimizer and scheduler decide "
            "here; see docs/megatron.md)"
        )

    # -- the layout -----------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether parameters, gradients and optimizer state are sharded (FSDP2) over the
        data-parallel processes: ``use_distributed_optimizer`` (or Megatron's own FSDP, or
        experts, which are split over shards)."""
        assert self.expert_model_parallel_size is not None
        return bool(
            self.use_distributed_optimizer
            or self.use_custom_fsdp
            or self.expert_model_parallel_size > 1
        )

    def to_parallelism_config(self) -> ParallelismConfig:
        """The :class:`~slipstream.ParallelismConfig` of the same layout; the data-parallel
        size is what the degrees leave (Megatron's rule).

        Example::

            MegatronLMPlugin(tp_degree=2, pp_degree=2).to_parallelism_config()
            # ParallelismConfig(dp_replicate_size=-1, tp_size=2, pp_size=2, ...)
        """
        tp, pp = int(self.tp_degree or 1), int(self.pp_degree or 1)
        cp, ep = int(self.context_parallel_size or 1), int(self.expert_model_parallel_size or 1)
        return ParallelismConfig(
            dp_replicate_size=None if self.sharded else -1,
            dp_shard_size=-1 if self.sharded else None,
            tp_size=tp if tp > 1 else None,
            pp_size=pp if pp > 1 else None,
            cp_size=cp if cp > 1 else None,
            ep_size=ep if ep > 1 else None,
            sequence_parallel=bool(self.sequence_parallelism) and tp > 1,
            # Megatron runs fewer micro-batches than stages (with a larger bubble); torch's
            # 1F1B refuses that, GPipe computes the same gradients.
            pp_schedule="1f1b" if int(self.num_micro_batches or 1) >= pp else "gpipe",
            pp_microbatches=int(self.num_micro_batches or 1) if pp > 1 else None,
        )

    @property
    def batch_factor(self) -> int:
        """DataLoader batches per prepared batch (Accelerate's Megatron path makes the
        DataLoader's batch size the micro-batch size)."""
        return int(self.num_micro_batches or 1)

    # -- config files ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, block: Mapping[str, Any]) -> MegatronLMPlugin:
        """Build from a ``megatron_lm_config`` block (``megatron_lm_tp_degree: 2`` ...; the
        prefix may be left out).

        Example::

            MegatronLMPlugin.from_config({"megatron_lm_tp_degree": 2})
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for raw_key, value in block.items():
            key = str(raw_key).removeprefix(CONFIG_PREFIX)
            if key not in fields:
                spelled = [CONFIG_PREFIX + name for name in fields]
                close = difflib.get_close_matches(CONFIG_PREFIX + key, spelled, 1, cutoff=0.8)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise MegatronLMConfigError(f"megatron_lm_config: unknown key '{raw_key}'{hint}")
            values[key] = _config_value(str(raw_key), value, str(fields[key].type))
        try:
            return cls(**values)
        except MegatronLMConfigError as error:
            text = str(error).replace("MegatronLMPlugin: ", "megatron_lm_config: ", 1)
            for name in fields:
                text = text.replace(f" {name} ", f" {CONFIG_PREFIX}{name} ")
            raise MegatronLMConfigError(text) from None


def _config_value(key: str, value: Any, annotation: str) -> Any:
    """A YAML (or command-line string) value converted to the field's type."""
    if value is None or value == "":
        return None
    if annotation.startswith("bool") and isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "1", "false", "no", "0"):
            return lowered in ("true", "yes", "1")
        raise MegatronLMConfigError(
            f"megatron_lm_config: {key} must be true or false, got {value!r}"
        )
    if annotation.startswith("int") and isinstance(value, str):
        if value.strip().lstrip("-").isdecimal():
            return int(value)
        raise MegatronLMConfigError(f"megatron_lm_config: {key} must be an integer, got {value!r}")
    if annotation.startswith("float") and isinstance(value, (str, int)):
        try:
            return float(value)
        except ValueError:
            raise MegatronLMConfigError(
                f"megatron_lm_config: {key} must be a number, got {value!r}"
            ) from None
    return value
