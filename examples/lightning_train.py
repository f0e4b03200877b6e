"""Lightning's Trainer on slipstream: one import, then strategy="slipstream".

A small classifier trained with ``lightning.pytorch.Trainer`` on 2 CPU processes through
slipstream's DDP (or FSDP2 / DeepSpeed ZeRO), with an exact distributed accuracy from
torchmetrics, checkpoints written through slipstream and bf16 weights exported by
ExportWeights. Needs Lightning and torchmetrics (pip install
"slipstream[lightning,torchmetrics]"). Run:

    python examples/lightning_train.py                    # Lightning starts 2 CPU processes
    python examples/lightning_train.py --strategy slipstream_fsdp --precision bf16-mixed
    python examples/lightning_train.py --strategy slipstream_deepspeed_stage_3
    slipstream launch -n 2 --cpu examples/lightning_train.py   # started by slipstream launch
    python examples/lightning_train.py --quick            # a few seconds (used by the tests)

Prints the held-out loss and accuracy before training and after every epoch. Run it again
with ``--resume`` to continue from the last checkpoint in ``--output``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from slipstream.integrations.lightning import ExportWeights  # also registers the names


class Classifier(pl.LightningModule):
    def __init__(self, features: int = 16, classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))
        # Exact under slipstream: samples the sampler repeats to even out shards are dropped.
        self.val_accuracy = MulticlassAccuracy(num_classes=classes)
        self.val_loss = MeanMetric()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, labels = batch
        logits = self(inputs)
        self.val_accuracy.update(logits, labels)
        self.val_loss.update(F.cross_entropy(logits, labels, reduction="none"))
        self.log("val_accuracy", self.val_accuracy)
        self.log("val_loss", self.val_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Report(pl.Callback):
    """Prints the held-out loss and accuracy after each validation (main process)."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # The metric objects, not the logged values: those are computed only after this hook.
        loss, accuracy = module.val_loss.compute(), module.val_accuracy.compute()
        when = (
            "before training"
            if trainer.state.fn == "validate"
            else f"epoch {trainer.current_epoch}"
        )
        if trainer.is_global_zero:
            print(f"{when}: held-out loss {float(loss):.4f}, accuracy {float(accuracy):.3f}")


class Data(pl.LightningDataModule):
    """Noisy labels from the first features; 1001 validation samples (uneven on purpose)."""

    def __init__(self, train: int, valid: int, batch_size: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(train + valid, 16, generator=generator)
        noise = 0.5 * torch.randn(train + valid, 4, generator=generator)
        labels = (inputs[:, :4] + noise).argmax(dim=1)
        self.train_set = TensorDataset(inputs[:train], labels[:train])
        self.valid_set = TensorDataset(inputs[train:], labels[train:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.valid_set, batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="slipstream")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed (default: fp32)")
    # Under slipstream launch / torchrun the process count comes from the launcher.
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    parser.add_argument("--epochs", type=int, default=None, help="default 5 (2 with --quick)")
    parser.add_argument("--output", default=str(Path(tempfile.gettempdir()) / "lightning_train"))
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # Lightning warns that validation on several processes counts repeated samples; with
    # slipstream's metrics it does not (they drop the repeats).
    warnings.filterwarnings("ignore", ".*it is recommended to use `Trainer\\(devices=1.*")

    pl.seed_everything(0)
    train = 1024 if args.quick else 8192
    epochs = args.epochs or (2 if args.quick else 5)
    data = Data(train=train, valid=1001, batch_size=16 if args.quick else 64)
    model = Classifier()
    checkpoints = ModelCheckpoint(dirpath=args.output, filename="{epoch}", save_last=False)
    # 16-bit weights for serving, gathered from any strategy's shards at the end of fit.
    export = ExportWeights(os.path.join(args.output, "weights"), dtype="bf16")
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_epochs=epochs,
        gradient_clip_val=1.0,
        callbacks=[checkpoints, export, Report()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,  # the validation before training checks the loop already
    )
    resume = None
    if args.resume:
        found = sorted(Path(args.output).glob("epoch=*.ckpt"), key=os.path.getmtime)
        resume = str(found[-1]) if found else None
    else:
        trainer.validate(model, data, verbose=False)  # the untrained model: chance level
    trainer.fit(model, data, ckpt_path=resume)
    accuracy = trainer.callback_metrics.get("val_accuracy")
    if trainer.is_global_zero and accuracy is None:
        print(f"{resume} had already trained {epochs} epochs; raise --epochs to continue")
    elif trainer.is_global_zero:
        print(
            f"{args.strategy} on {trainer.world_size} process(es), precision "
            f"{trainer.precision}: validation accuracy {float(accuracy):.4f} over 1001 samples; "
            f"checkpoint {checkpoints.best_model_path}; bf16 weights {export.exported[-1]}"
        )


if __name__ == "__main__":
    main()
