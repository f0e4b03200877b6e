"""Lightning Trainer callbacks that bring slipstream features to any Trainer.

* :class:`ExportWeights` writes the model's consolidated weights (16-bit or fp32) as sharded
  safetensors with an index to any fsspec URL, gathered from DDP, FSDP or DeepSpeed ZeRO-3
  through the core.
* :class:`ExactMetrics` makes torchmetrics metrics exact on uneven validation/test sets
  under Lightning's own strategies (``strategy="slipstream..."`` does this by itself).

Example::

    from slipstream.integrations.lightning import ExactMetrics, ExportWeights

    trainer = pl.Trainer(
        strategy="slipstream_fsdp",
        callbacks=[ExportWeights("s3://bucket/run/weights", dtype="bf16"), ExactMetrics()],
    )
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from slipstream.checkpoint.weights import export_weights
from slipstream.runtime.state import ProcessState

from .checkpoint_io import on_main
from .metrics import EvaluationPasses, attach_exact_metrics
from .strategy import SlipstreamStrategy

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
}


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"ExportWeights: dtype {dtype} is not a floating-point type")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(
            f"ExportWeights: unknown dtype {dtype!r}; use one of {sorted(DTYPES)}, a "
            "torch.dtype, or None to keep the model's own dtypes"
        )
    return DTYPES[dtype]


def _process_state(trainer: pl.Trainer) -> ProcessState:
    """The core view of the Trainer's processes (adopting Lightning's own process group)."""
    strategy = trainer.strategy
    if isinstance(strategy, SlipstreamStrategy) and strategy.state is not None:
        return strategy.state
    return ProcessState.from_environment(cpu=strategy.root_device.type == "cpu")


def _full_weights(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The full weights on the main process; a collective on every process."""
    strategy = trainer.strategy
    if isinstance(strategy, SlipstreamStrategy):
        return strategy.full_state_dict()
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        raise RuntimeError(
            "ExportWeights cannot gather DeepSpeed ZeRO-3 partitions under Lightning's own "
            "DeepSpeed strategy; use strategy='slipstream_deepspeed_stage_3' (same config)"
        )
    # DDP and single-device return the module's state; Lightning's FSDP gathers it
    # (state_dict_type="full") to the main process.
    return dict(strategy.lightning_module_state_dict())


class ExportWeights(pl.Callback):
    """Write the model's consolidated weights at the end of fit, or every n epochs.

    ``url`` is a folder on any fsspec filesystem; it may contain ``{epoch}`` (e.g.
    ``"runs/weights/epoch={epoch}"``) to keep one export per epoch, otherwise each export
    replaces the previous one atomically (see :func:`slipstream.checkpoint.export_weights`).
    ``dtype`` is ``"bf16"`` (default), ``"fp16"``, ``"fp32"``, a ``torch.dtype``, or None
    for the model's own dtypes. Only keys under ``prefix`` (e.g. ``"model."``) are written,
    with the prefix removed, so the folder loads straight into the wrapped plain module. Every
    process takes part (sharded weights are gathered); only the main process writes.

    Example::

        trainer = pl.Trainer(callbacks=[ExportWeights("s3://bucket/run/weights")])
        trainer.fit(model)
        net.load_state_dict(slipstream.checkpoint.load_weights("s3://bucket/run/weights"))
    """

    def __init__(
        self,
        url: str,
        dtype: str | torch.dtype | None = "bf16",
        every_n_epochs: int | None = None,
        max_shard_size: int | str = "10GB",
        prefix: str = "",
    ) -> None:
        if every_n_epochs is not None and (
            isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int)
        ):
            raise TypeError(f"ExportWeights: every_n_epochs must be an int, got {every_n_epochs!r}")
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(
                f"ExportWeights: every_n_epochs must be >= 1 (or None for the end of fit only), "
                f"got {every_n_epochs}"
            )
        from slipstream.checkpoint.serialization import parse_size

        parse_size(max_shard_size)  # a bad size fails now, not after hours of training
        self.url = str(url)
        self.dtype = _parse_dtype(dtype)
        self.every_n_epochs = every_n_epochs
        self.max_shard_size = max_shard_size
        self.prefix = prefix
        self.exported: list[str] = []
        self._epoch = 0  # the epoch the latest optimizer step happened in
        self._exported_step: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A prefix that matches nothing fails before training, not when the export is due.
        keys = pl_module.state_dict().keys()
        if not any(key.startswith(self.prefix) for key in keys):
            raise ValueError(
                f"ExportWeights: no weights under prefix {self.prefix!r}; the model's keys "
                f"start with {sorted({key.split('.')[0] + '.' for key in keys})}"
            )

    def destination(self, epoch: int) -> str:
        return self.url.format(epoch=epoch) if "{epoch}" in self.url else self.url

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = trainer.current_epoch
        n = self.every_n_epochs
        if n is not None and (trainer.current_epoch + 1) % n == 0:
            self.export(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._exported_step != trainer.global_step:  # not already written these weights
            self.export(trainer, pl_module)

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """Gather and write the weights now (call on every process); returns the URL."""
        weights = _full_weights(trainer, pl_module)
        selected = {
            key[len(self.prefix) :]: value
            for key, value in weights.items()
            if key.startswith(self.prefix) and isinstance(value, torch.Tensor)
        }
        url = self.destination(self._epoch)
        state = _process_state(trainer)

        on_main(
            state,
            lambda: export_weights(
                selected, url, max_shard_size=self.max_shard_size, dtype=self.dtype
            ),
        )
        self._exported_step = trainer.global_step
        self.exported.append(url)
        return url


class ExactMetrics(pl.Callback):
    """Count every validation/test sample once in the module's torchmetrics metrics.

    Lightning's ``DistributedSampler`` pads an uneven evaluation set with repeated samples;
    this callback drops them from each metric's ``update`` and syncs metric states of
    unequal sizes, so ``self.log("val_acc", self.val_acc)`` equals the single-process value.
    Needed with Lightning's own strategies ("ddp", ...); ``strategy="slipstream..."``
    already does it, and there the callback does nothing.

    Example::

        trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[ExactMetrics()])
    """

    def __init__(self) -> None:
        self.passes = EvaluationPasses()
        self.attached = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, SlipstreamStrategy):
            return
        self.attached += attach_exact_metrics(pl_module, _process_state(trainer), self.passes)

    def _start(self, trainer: pl.Trainer) -> None:
        if not isinstance(trainer.strategy, SlipstreamStrategy):
            self.passes.start(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.passes.stop()

    on_test_end = on_validation_end

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.passes.dataloader_idx = dataloader_idx

    on_test_batch_start = on_validation_batch_start
