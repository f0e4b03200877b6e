"""transformers' ``Trainer`` and TRL's trainers on slipstream: one import.

``transformers.Trainer`` builds an Accelerate ``Accelerator`` inside; this package's
:class:`Trainer` builds slipstream's instead, from the same ``TrainingArguments`` (see
docs/transformers.md for what maps to what and what is refused). Any Trainer subclass, such
as TRL's ``SFTTrainer``, gets the same with :func:`on_slipstream` or by putting
:class:`SlipstreamTrainerMixin` first among its bases.

Example::

    from slipstream.integrations.transformers import Trainer      # was: from transformers
    trainer = Trainer(model=model, args=TrainingArguments("out"), train_dataset=data)
    trainer.train()
"""

from .accelerator import TrainerConfigurationError, accelerator_arguments, build_accelerator
from .routing import route_trainer_functions
from .trainer import SlipstreamTrainerMixin, Trainer, on_slipstream

__all__ = [
    "SlipstreamTrainerMixin",
    "Trainer",
    "TrainerConfigurationError",
    "accelerator_arguments",
    "build_accelerator",
    "on_slipstream",
    "route_trainer_functions",
]
