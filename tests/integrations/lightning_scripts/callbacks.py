"""Lightning Trainer runs for tests/integrations/test_lightning_callbacks.py.

``python callbacks.py SCENARIO OUTPUT_DIR`` (Lightning re-runs it per process; rank 0
writes ``OUTPUT_DIR/result.json``). Scenarios: export (ExportWeights under slipstream's
DDP, FSDP and ZeRO-3 and Lightning's own "ddp"), exact (ExactMetrics under Lightning's
"ddp" on uneven evaluation sets), prefix (a bad prefix, one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from fit import FEATURES, Regression, loader, main, seed, trainer_for
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.lightning import ExactMetrics, ExportWeights

PROBE = torch.randn(5, FEATURES, generator=torch.Generator().manual_seed(7))
STRATEGIES = ("slipstream", "slipstream_fsdp", "slipstream_deepspeed_stage_3", "ddp")


class Probe(pl.Callback):
    """The trained model's outputs on PROBE, computed by the (sharded) model itself."""

    outputs: list[list[float]]

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        with torch.no_grad():  # a collective under FSDP / ZeRO-3: every process calls it
            self.outputs = module(PROBE.to(module.device)).float().tolist()


def scenario_export(out: Path) -> dict:
    result: dict[str, Any] = {}
    for name in STRATEGIES:
        seed()
        probe = Probe()
        callbacks: list[pl.Callback] = [
            probe,
            ExportWeights(str(out / name / "fp32"), dtype="fp32"),
            ExportWeights(str(out / name / "bf16")),
        ]
        if name == "slipstream":
            per_epoch = ExportWeights(
                str(out / "every" / "epoch={epoch}"),
                dtype=None,
                every_n_epochs=1,
                max_shard_size=300,
            )
            in_memory = ExportWeights("memory://exports/weights", dtype="fp16")
            callbacks += [per_epoch, in_memory]
        trainer = trainer_for(name, epochs=2, callbacks=callbacks)
        trainer.fit(Regression(), loader())
        result[name] = {"outputs": probe.outputs}
        if name == "slipstream":
            result["every"] = per_epoch.exported
            if trainer.is_global_zero:  # memory:// lives in the process that wrote it
                from slipstream.checkpoint import load_weights

                written = load_weights("memory://exports/weights")
                result["memory_dtypes"] = sorted({str(t.dtype) for t in written.values()})
    return result


def classifier_data(samples: int, seed_value: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed_value)
    inputs = torch.randn(samples, 16, generator=generator)
    labels = (inputs[:, :4] + torch.randn(samples, 4, generator=generator)).argmax(dim=1)
    return TensorDataset(inputs, labels)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

        super().__init__()
        self.net = nn.Linear(16, 4)
        self.accuracy = nn.ModuleList([MulticlassAccuracy(num_classes=4) for _ in range(2)])
        self.auroc = MulticlassAUROC(num_classes=4)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        logits = self.net(batch[0])
        self.accuracy[dataloader_idx].update(logits, batch[1])
        self.log(
            f"accuracy_{dataloader_idx}", self.accuracy[dataloader_idx], add_dataloader_idx=False
        )
        if dataloader_idx == 0:
            self.auroc.update(logits.softmax(-1), batch[1])
            self.log("auroc", self.auroc, add_dataloader_idx=False)

    test_step = validation_step


def scenario_exact(out: Path) -> dict:
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

    sets = [classifier_data(1001, 1), classifier_data(37, 2)]
    loaders = [DataLoader(data, batch_size=16) for data in sets]
    values: dict[str, Any] = {}
    for label, strategy, callbacks in (
        ("ddp_exact", "ddp", [ExactMetrics()]),
        ("ddp_plain", "ddp", []),
        ("slipstream_exact", "slipstream", [ExactMetrics()]),
    ):
        seed()
        model = Classifier()
        trainer = trainer_for(strategy, callbacks=callbacks)
        values[label] = trainer.validate(model, loaders, verbose=False)
        values[f"{label}_test"] = trainer.test(model, loaders, verbose=False)
        if callbacks:
            values[f"{label}_attached"] = callbacks[0].attached
    # The single-process values: every sample once, no syncing.
    reference: dict[str, float] = {}
    with torch.no_grad():
        for index, data in enumerate(sets):
            inputs, labels = data.tensors
            logits = model.net(inputs)
            accuracy = MulticlassAccuracy(num_classes=4, sync_on_compute=False)
            accuracy.update(logits, labels)
            reference[f"accuracy_{index}"] = float(accuracy.compute())
            if index == 0:
                auroc = MulticlassAUROC(num_classes=4, sync_on_compute=False)
                auroc.update(logits.softmax(-1), labels)
                reference["auroc"] = float(auroc.compute())
    values["reference"] = reference
    return values


def scenario_prefix(out: Path) -> dict:
    seed()
    export = ExportWeights(str(out / "weights"), prefix="missing.")
    try:
        trainer_for("auto", epochs=1, devices=1, callbacks=[export]).fit(Regression(), loader())
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "written": (out / "weights").exists()}
    return {"error": None}


if __name__ == "__main__":
    main(globals())
