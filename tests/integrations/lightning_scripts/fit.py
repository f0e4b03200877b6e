"""Lightning Trainer runs for tests/integrations/test_lightning.py.

``python fit.py SCENARIO OUTPUT_DIR``: with ``devices=2`` Lightning re-runs this script once
per extra process, so every scenario is a plain function of the script; rank 0 writes
``OUTPUT_DIR/result.json`` (scenario "launch": every rank writes ``rank<r>.json``).

Scenarios: ddp (parity with Lightning's "ddp", logging, accumulation + clipping, precision,
fit/validate/test/predict, resume from a local checkpoint, exact torchmetrics), fsdp,
deepspeed, launch (started by ``slipstream launch``), single (one process, memory://).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.lightning import SlipstreamPrecision, SlipstreamStrategy

warnings.filterwarnings("ignore")

FEATURES, SAMPLES, BATCH = 8, 64, 4


def seed() -> None:
    try:
        pl.seed_everything(0, verbose=False)
    except TypeError:  # Lightning < 2.3 has no `verbose`
        pl.seed_everything(0)


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs.sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(inputs, targets)


def loader() -> DataLoader:
    return DataLoader(regression_data(), batch_size=BATCH)


class Regression(pl.LightningModule):
    """Two layers, SGD with momentum (so resuming must restore optimizer state)."""

    def __init__(self, call_submodule: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.call_submodule = call_submodule
        self.autocast_seen: bool | None = None
        self.weight_dtype: str | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        outputs = self.net(inputs) if self.call_submodule else self(inputs)
        return F.mse_loss(outputs.float(), targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.autocast_seen = torch.is_autocast_enabled("cpu")
        self.weight_dtype = str(self.net[0].weight.dtype)  # as forward sees it (FSDP/DeepSpeed)
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        rank = torch.tensor(self.global_rank + 1.0)
        self.log("rank_mean", rank, on_step=False, on_epoch=True, sync_dist=True)
        self.log("rank_max", rank, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Manual(Regression):
    """Manual optimization: manual_backward and optimizer steps written by the user."""

    def __init__(self, call_submodule: bool = False) -> None:
        super().__init__(call_submodule)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


def full_weights(trainer: pl.Trainer) -> dict[str, list[float]]:
    """The full weights (collective under FSDP/DeepSpeed), as lists, on rank 0."""
    strategy = trainer.strategy
    if isinstance(strategy, SlipstreamStrategy):
        state = strategy.full_state_dict()
    else:
        state = trainer.lightning_module.state_dict()
    return {k: v.detach().float().flatten().tolist() for k, v in state.items()}


class Recorder(pl.Callback):
    """Weights when training starts (after a restore) and ends; the loss of every epoch."""

    def __init__(self) -> None:
        self.start: dict[str, list[float]] = {}
        self.end: dict[str, list[float]] = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = full_weights(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.end = full_weights(trainer)


def trainer_for(strategy: Any, epochs: int = 2, devices: int = 2, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **kwargs,
    )


def fit(strategy: Any, epochs: int = 2, ckpt_path: str | None = None, **kwargs: Any) -> dict:
    seed()
    model_class = kwargs.pop("model_class", Regression)
    model = model_class(call_submodule=kwargs.pop("call_submodule", False))
    recorder = Recorder()
    callbacks = [recorder, *kwargs.pop("callbacks", [])]
    trainer = trainer_for(strategy, epochs, callbacks=callbacks, **kwargs)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return {
        "trainer": trainer,
        "model": model,
        "start": recorder.start,
        "end": recorder.end,
        "losses": recorder.losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "precision": str(trainer.precision),
        "autocast": model.autocast_seen,
        "weight_dtype": model.weight_dtype,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def public(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("trainer", "model")}


# -- scenarios ---------------------------------------------------------------------------------
ACCUMULATE = {"accumulate_grad_batches": 3, "gradient_clip_val": 0.05}


def collectives(strategy: Any) -> dict:
    """Lightning's collective API, answered by slipstream's collectives."""
    rank = strategy.global_rank
    gathered = strategy.all_gather(torch.full((2, 3), float(rank)))
    x = torch.tensor([rank + 1.0], requires_grad=True)
    stacked = strategy.all_gather(x, sync_grads=True)
    (stacked * torch.tensor([[1.0], [10.0]])).sum().backward()
    return {
        "group": [strategy.state.launch.source, strategy.state.owns_process_group],
        "gather_shape": list(gathered.shape),
        "gather_values": gathered[:, 0, 0].tolist(),
        "sync_grads": x.grad.tolist(),
        "broadcast": strategy.broadcast({"rank": rank}, src=1),
        "sum": float(strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum")),
        "max": float(strategy.reduce(torch.tensor(rank + 1.0), reduce_op=ReduceOp.MAX)),
        "mean": float(strategy.reduce(torch.tensor(rank + 1.0))),
        "not_a_tensor": strategy.reduce("text"),
        "all": strategy.reduce_boolean_decision(rank == 0, all=True),
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
    }


def scenario_ddp(out: Path) -> dict:
    result: dict[str, Any] = {}
    # Plain fit: slipstream first (it creates the process group), Lightning's DDP adopts it.
    slip = fit("slipstream")
    result["plain"] = {"slipstream": public(slip), "ddp": public(fit("ddp"))}
    trainer = slip["trainer"]
    model = slip["model"]
    result["stages"] = {
        "validate": trainer.validate(model, loader(), verbose=False)[0],
        "test": trainer.test(model, loader(), verbose=False)[0],
        "predict_rows": sum(len(p) for p in trainer.predict(model, loader())),
    }
    result["collectives"] = collectives(trainer.strategy)
    result["manual"] = {
        "slipstream": public(fit("slipstream", model_class=Manual)),
        "ddp": public(fit("ddp", model_class=Manual)),
    }
    result["accumulate"] = {
        "slipstream": public(fit("slipstream", **ACCUMULATE)),
        "ddp": public(fit("ddp", **ACCUMULATE)),
    }
    result["bf16"] = public(fit("slipstream", precision="bf16-mixed"))
    result["fp16_trainer"] = public(fit("slipstream", precision="16-mixed"))
    fp16 = fit(SlipstreamStrategy(precision="16-mixed"))
    plugin = fp16["trainer"].precision_plugin
    result["fp16_strategy"] = {
        **public(fp16),
        "plugin": type(plugin).__name__,
        "scale": plugin.scaler.get_scale() if isinstance(plugin, SlipstreamPrecision) else None,
    }
    # Resume: 1 epoch, save to a local path, continue to 2 epochs from the checkpoint.
    first = fit("slipstream", epochs=1)
    path = str(out / "ddp.ckpt")
    first["trainer"].save_checkpoint(path)
    resumed = fit("slipstream", epochs=2, ckpt_path=path)
    result["resume"] = {"saved": first["end"], **public(resumed)}
    bf16_path = str(out / "bf16.ckpt")
    fit(SlipstreamStrategy(weights_dtype=torch.bfloat16), epochs=1)["trainer"].save_checkpoint(
        bf16_path
    )
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        saved = torch.load(bf16_path, weights_only=True)["state_dict"]
        result["weights_dtype"] = sorted({str(v.dtype) for v in saved.values()})
    result["metrics"] = exact_metrics()
    return result


def exact_metrics() -> dict:
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(1001, 16, generator=generator)
    labels = (inputs[:, :4] + torch.randn(1001, 4, generator=generator)).argmax(dim=1)
    data = DataLoader(TensorDataset(inputs, labels), batch_size=16)

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 4)
            self.accuracy = MulticlassAccuracy(num_classes=4)
            self.auroc = MulticlassAUROC(num_classes=4)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            logits = self.net(batch[0])
            self.accuracy.update(logits, batch[1])
            self.auroc.update(logits.softmax(-1), batch[1])
            self.log("accuracy", self.accuracy)
            self.log("auroc", self.auroc)

    values: dict[str, float] = {}
    for name in ("slipstream", "ddp"):
        seed()
        model = Classifier()
        logged = trainer_for(name).validate(model, data, verbose=False)[0]
        values[f"{name}_accuracy"] = logged["accuracy"]
        values[f"{name}_auroc"] = logged["auroc"]
    # The single-process value: every sample once, no syncing.
    accuracy = MulticlassAccuracy(num_classes=4, sync_on_compute=False)
    auroc = MulticlassAUROC(num_classes=4, sync_on_compute=False)
    with torch.no_grad():
        logits = model.net(inputs)
    accuracy.update(logits, labels)
    auroc.update(logits.softmax(-1), labels)
    values["exact_accuracy"] = float(accuracy.compute())
    values["exact_auroc"] = float(auroc.compute())
    return values


def scenario_fsdp(out: Path) -> dict:
    sharded = {"kind": "fsdp", "fsdp_options": {"state_dict_type": "SHARDED_STATE_DICT"}}
    directory = out / "fsdp"
    # Every 4 of the 8 steps: the second save removes the first (a sharded folder).
    checkpoints = ModelCheckpoint(
        dirpath=str(directory), filename="{epoch}-{step}", every_n_train_steps=4
    )
    first = fit(
        SlipstreamStrategy(**sharded, weights_dtype=torch.bfloat16),  # + consolidated bf16 weights
        epochs=1,
        callbacks=[checkpoints],
        enable_checkpointing=True,
    )
    saved = checkpoints.best_model_path
    # Restored from ModelCheckpoint's folder (saved at the end of a batch) and from one saved
    # after fit (end of epoch: continuing gives the uninterrupted run in every Lightning 2.x;
    # older ones replay a step after a checkpoint taken on an epoch's last batch).
    from_callback = fit(SlipstreamStrategy(**sharded), epochs=2, ckpt_path=saved)
    after_fit = str(out / "fsdp_after_fit.ckpt")
    first["trainer"].save_checkpoint(after_fit)
    resumed = fit(SlipstreamStrategy(**sharded), epochs=2, ckpt_path=after_fit)
    straight = fit(SlipstreamStrategy(**sharded), epochs=2, call_submodule=True)
    full_path = str(out / "fsdp_full.ckpt")
    full_first = fit("slipstream_fsdp", epochs=1)
    full_first["trainer"].save_checkpoint(full_path)
    full_resumed = fit("slipstream_fsdp", epochs=2, ckpt_path=full_path)
    consolidated = os.path.join(saved, "model.safetensors")
    dtypes = []
    if os.path.exists(consolidated):
        from safetensors.torch import load_file

        dtypes = sorted({str(t.dtype) for t in load_file(consolidated).values()})
    return {
        "consolidated_dtypes": dtypes,
        "accumulate": public(fit(SlipstreamStrategy(**sharded), **ACCUMULATE)),
        "ddp_accumulate": public(fit("ddp", **ACCUMULATE)),
        "bf16": public(fit(SlipstreamStrategy(**sharded), precision="bf16-mixed")),
        "saved_path": saved,
        "saved_is_dir": os.path.isdir(saved),
        "saved_files": sorted(os.listdir(saved)) if os.path.isdir(saved) else [],
        "checkpoints": sorted(os.listdir(directory)),
        "first": public(first),
        "from_callback": public(from_callback),
        "resumed": public(resumed),
        "straight": public(straight),
        "ddp": public(fit("ddp")),
        "full_is_file": os.path.isfile(full_path),
        "full_first": public(full_first),
        "full_resumed": public(full_resumed),
    }


def scenario_deepspeed(out: Path) -> dict:
    path = str(out / "zero3.ckpt")
    first = fit("slipstream_deepspeed_stage_3", epochs=1)
    first["trainer"].save_checkpoint(path)
    # A new engine for evaluation after fit (as Lightning's own DeepSpeed strategy does).
    validated = first["trainer"].validate(first["model"], loader(), verbose=False)[0]
    resumed = fit("slipstream_deepspeed_stage_3", epochs=2, ckpt_path=path)
    return {
        "validated": validated,
        "accumulate": public(fit("slipstream_deepspeed_stage_3", **ACCUMULATE)),
        "ddp_accumulate": public(fit("ddp", **ACCUMULATE)),
        "bf16": public(fit("slipstream_deepspeed_stage_3", precision="bf16-mixed")),
        "saved_files": sorted(os.listdir(path)) if os.path.isdir(path) else [],
        "first": public(first),
        "resumed": public(resumed),
        "straight": public(fit("slipstream_deepspeed_stage_3")),
        "ddp": public(fit("ddp")),
    }


def scenario_launch(out: Path) -> dict:
    run = fit("slipstream", epochs=1)
    strategy = run["trainer"].strategy
    rank = run["trainer"].global_rank
    report = {
        "pid": os.getpid(),
        "rank": rank,
        "world_size": run["trainer"].world_size,
        "precision": run["precision"],
        "kind": strategy.kind,
        "cluster": type(strategy.cluster_environment).__name__,
        "losses": run["losses"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    return report


def scenario_single(out: Path) -> dict:
    run = fit("slipstream", epochs=1, devices=1)
    url = "memory://lightning-test/single.ckpt"
    run["trainer"].save_checkpoint(url)
    resumed = fit("slipstream", epochs=2, devices=1, ckpt_path=url)
    from slipstream.integrations.fsspec import FsspecCheckpointIO

    loaded = FsspecCheckpointIO().load_checkpoint(url)
    return {
        "saved": run["end"],
        "loaded": {k: v.flatten().tolist() for k, v in loaded["state_dict"].items()},
        "loaded_epoch": loaded["epoch"],
        "resumed": public(resumed),
        "world_size": run["trainer"].world_size,
        "launcher": type(run["trainer"].strategy.launcher).__name__,
    }


def main(scenarios: dict[str, Any] | None = None) -> None:
    """Run ``scenario_<argv[1]>`` from ``scenarios`` (this module's by default)."""
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    result = (scenarios or globals())[f"scenario_{scenario}"](out)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
