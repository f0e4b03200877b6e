"""The Trainer on slipstream: a mixin for any ``transformers.Trainer`` subclass, and the
class decorator and ``Trainer`` built from it.

Example::

    from slipstream.integrations.transformers import Trainer      # was: from transformers
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.train()

    from trl import SFTTrainer
    from slipstream.integrations.transformers import on_slipstream
    trainer = on_slipstream(SFTTrainer)(model=model, args=config, train_dataset=data)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import transformers

from .accelerator import TrainerConfigurationError, build_accelerator
from .routing import route_trainer_functions

T = TypeVar("T", bound=type)


class SlipstreamTrainerMixin:
    """Gives a ``transformers.Trainer`` subclass slipstream's Accelerator.

    Put it first among the bases (``class MyTrainer(SlipstreamTrainerMixin, SFTTrainer)``)
    or use :func:`on_slipstream`. ``accelerator_options`` passes further arguments to
    slipstream's Accelerator: ``parallelism_config`` (tensor, pipeline, expert parallel
    sizes), ``fault_tolerance``, ``hang_timeout``, ``callbacks`` (``BadStepGuard``...).

    Everything else is the Trainer's: its loop, accumulation, logging, evaluation and
    checkpoint folders. slipstream's Accelerator shards the data, wraps the model for the
    strategy the arguments ask for, saves and loads FSDP2 checkpoints, and keeps every count
    of "processes" to the data-parallel ones (tensor- and pipeline-parallel peers read the
    same batch).
    """

    accelerator: Any
    args: Any
    model: Any

    def __init__(
        self, *args: Any, accelerator_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self.accelerator_options = dict(accelerator_options or {})
        route_trainer_functions()
        super().__init__(*args, **kwargs)

    # -- the accelerator ------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """Build slipstream's Accelerator from the TrainingArguments (see
        :mod:`slipstream.integrations.transformers.accelerator`), then set what the
        Trainer reads of it, as the Trainer does after building Accelerate's."""
        self.accelerator = build_accelerator(self, self.accelerator_options)
        gather = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(gather).parameters:
            gather = functools.partial(gather, use_gather_object=self.args.eval_use_gather_object)
        self.gather_function = gather
        state, strategy = self.accelerator.state, self.accelerator.strategy
        if state.fsdp_plugin is None and strategy.name == "model_parallel":
            # Tensor-, pipeline- and expert-parallel layouts hold DTensors as FSDP2 does:
            # the Trainer saves and loads them on its FSDP path (save_fsdp_model, ...), with
            # the layout's checkpoint options (sharded by default).
            state.fsdp_plugin = strategy.plugin
        self.is_deepspeed_enabled = state.deepspeed_plugin is not None
        self.is_fsdp_enabled = state.fsdp_plugin is not None
        self._check_arguments(state.fsdp_plugin)

    def _check_arguments(self, fsdp_plugin: Any) -> None:
        args = self.args
        if fsdp_plugin is None:
            return
        if fsdp_plugin.activation_checkpointing and args.activation_checkpointing:
            raise TrainerConfigurationError(
                "fsdp_config['activation_checkpointing'] and the activation_checkpointing "
                "argument both recompute activations: keep the FSDP one"
            )
        if args.save_only_model and args.load_best_model_at_end:
            raise TrainerConfigurationError(
                "FSDP cannot combine save_only_model with load_best_model_at_end: the best "
                "checkpoint would have no optimizer state to resume from"
            )
        if args.save_only_model and fsdp_plugin.sharded_state_dict:
            raise TrainerConfigurationError(
                "save_only_model does not fit state_dict_type SHARDED_STATE_DICT (the model "
                "is saved in shards with its optimizer); use FULL_STATE_DICT"
            )

    # -- saving ---------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; with sharded checkpoints (FSDP2's
        ``SHARDED_STATE_DICT``, slipstream's parallel layouts) a call of your own still
        writes the whole model, gathered (``from_pretrained`` loads it), where Accelerate's
        Trainer writes nothing. Checkpoints keep their shards only."""
        plugin = self.accelerator.state.fsdp_plugin
        if _internal_call or plugin is None or not plugin.sharded_state_dict:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        state_dict = self.accelerator.get_state_dict(self.model)  # every process takes part
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)  # type: ignore[attr-defined]
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)  # type: ignore[attr-defined]

    # -- processes that share a batch ----------------------------------------------------
    def _batch_sharing_processes(self) -> int:
        """Processes that read the same batch (tensor, context and pipeline parallel peers):
        all of them divided by the data-parallel ones."""
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None:
            return 1
        state = accelerator.state
        return max(1, state.num_processes // state.data_parallel_size)

    def get_tp_size(self) -> int:
        """The processes that share each batch. The Trainer divides by it (with
        ``get_cp_size`` and ``get_sp_size``, here 1) to count data-parallel processes, so
        under slipstream's layouts it counts tensor-, context- and pipeline-parallel peers."""
        return self._batch_sharing_processes()

    def get_cp_size(self) -> int:
        return 1

    def get_sp_size(self) -> int:
        return 1

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        # The Trainer divides the count by get_tp_size() because Accelerate's gather counts
        # each batch once per process sharing it; slipstream's gathers over the data-parallel
        # processes only, so the count is already right: undo the division.
        count = super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        sharing = self._batch_sharing_processes()
        if isinstance(count, torch.Tensor) and sharing > 1:
            count = count * sharing
        return count

    # -- pipeline parallelism -------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's step; under pipeline parallelism forward and backward run together
        through ``accelerator.forward_backward`` (each micro-batch's loss is the model's own,
        averaged over the batch and divided by the micro-batches of this step)."""
        from slipstream.parallel.pipeline import model_loss, pipeline_of

        inner = getattr(model, "_orig_mod", model)
        if pipeline_of(inner) is None:
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc,no-any-return]
        model.train()
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        loss_of = model_loss(inner)
        steps = self.current_gradient_accumulation_steps  # type: ignore[attr-defined]

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return loss_of(logits, labels) / steps

        loss: torch.Tensor = self.accelerator.forward_backward(model, loss_fn=loss_fn, **inputs)
        return loss.detach()


def on_slipstream(trainer_class: T) -> T:
    """``trainer_class`` (``transformers.Trainer`` or a subclass such as TRL's
    ``SFTTrainer``) running on slipstream's Accelerator: a subclass with
    :class:`SlipstreamTrainerMixin` first.

    Example::

        SFTTrainer = on_slipstream(trl.SFTTrainer)
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"on_slipstream takes a transformers.Trainer class; got {trainer_class!r}")
    if issubclass(trainer_class, SlipstreamTrainerMixin):
        return trainer_class
    name = trainer_class.__name__
    made = type(name, (SlipstreamTrainerMixin, trainer_class), {"__doc__": trainer_class.__doc__})
    return made  # type: ignore[return-value]


class Trainer(SlipstreamTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` on slipstream's Accelerator (see
    :class:`SlipstreamTrainerMixin`): the same arguments, plus ``accelerator_options``."""
