"""Lightning Trainer runs for tests/integrations/test_lightning_model_parallel.py.

``python model_parallel.py SCENARIO OUTPUT_DIR``: Lightning re-runs the script once per
extra process; every rank writes ``OUTPUT_DIR/rank<r>.json`` (its mesh coordinates, its
sampler and the samples it trained on) and rank 0 writes ``OUTPUT_DIR/result.json``.

Scenarios:

* ``tp2`` (2 processes, tp=2): fit, then validate; accumulation + clipping; bf16-mixed; fit
  1 epoch, save, resume with ``ckpt_path``; resume the same checkpoint under another layout
  (dp_shard=2); collectives.
* ``tp2_dp2`` (4 processes, dp_shard=2 x tp=2): fit 1 epoch, save, resume; HSDP
  (dp_replicate=2 x dp_shard=2) for one epoch.
* ``ep2`` (2 processes, experts over ep=2): a mixture of experts fits 1 epoch, saves,
  resumes for a second.

Each scenario also trains a Lightning-free reference in plain torch on one process (rank 0),
from the same initial weights and on the same global batches.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from fit import BATCH, FEATURES, SAMPLES, full_weights, main, regression_data, seed, trainer_for
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics import SumMetric

from slipstream import ParallelismConfig
from slipstream.integrations.lightning import SlipstreamStrategy

warnings.filterwarnings("ignore")

PLAN = {"mlp.up": "colwise", "mlp.down": "rowwise"}
VALIDATION_SAMPLES = 31  # odd: with 2 data-parallel processes the sampler repeats one
LR, MOMENTUM = 0.05, 0.9
ACCUMULATE = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
Weights = dict[str, list[float]]


# -- the network, shared by the LightningModule and the reference ---------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)  # split by output features over tp ("colwise")
        self.down = nn.Linear(32, 16)  # split by input features over tp ("rowwise")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(hidden)))


def add_layers(module: nn.Module) -> None:
    """Layers outside the plan (embed, head) stay whole and are only sharded by FSDP."""
    module.embed = nn.Linear(FEATURES, 16)
    module.mlp = MLP()
    module.head = nn.Linear(16, 1)


def run_layers(module: Any, inputs: torch.Tensor) -> torch.Tensor:
    return module.head(torch.tanh(module.mlp(torch.tanh(module.embed(inputs)))))


class Experts(nn.Module):
    """Four experts stacked as 3-D parameters, called with the router's choice."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 32, 16) * 0.2)
        self.w_out = nn.Parameter(torch.randn(4, 16, 32) * 0.2)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(self.w_in.shape[0]):
            token, slot = torch.where(index == expert)
            hidden = torch.tanh(x[token] @ self.w_in[expert].T) @ self.w_out[expert].T
            out = out.index_add(0, token, hidden * weights[token, slot, None])
        return out


def add_expert_layers(module: nn.Module) -> None:
    module.embed = nn.Linear(FEATURES, 16)
    module.router = nn.Linear(16, 4, bias=False)
    module.experts = Experts()  # split over ep by ParallelismConfig(ep_plan=["experts"])
    module.head = nn.Linear(16, 1)


def run_expert_layers(module: Any, inputs: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(module.embed(inputs))
    weights, index = torch.softmax(module.router(hidden), -1).topk(2, dim=-1)
    hidden = hidden + module.experts(hidden, index, weights / weights.sum(-1, keepdim=True))
    return module.head(hidden)


class ExpertNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        add_expert_layers(self)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return run_expert_layers(self, inputs)


class Net(nn.Module):
    """The plain torch model of the reference (the same names as the LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        add_layers(self)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return run_layers(self, inputs)


def indexed(data: TensorDataset) -> TensorDataset:
    """The dataset with each sample's index, so every process can report what it read."""
    return TensorDataset(*data.tensors, torch.arange(len(data)))


def validation_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(VALIDATION_SAMPLES, FEATURES, generator=generator)
    return TensorDataset(inputs, inputs.sum(1, keepdim=True) * 0.3)


class TensorParallelRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        add_layers(self)
        self.val_seen = SumMetric()  # counts validation samples: exact only if none repeats
        self.seen: list[int] = []  # sample indices this process trained on in epoch 0
        self.mesh_dims: list[str] = []
        self.weight_dtype = ""  # of a split layer's weight (fp32 master weights under autocast)
        self.compute_dtype = ""  # of a split layer's output, as forward computes it

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return run_layers(self, inputs)

    def on_fit_start(self) -> None:
        mesh = self.device_mesh  # set by the strategy, as Lightning's ModelParallelStrategy
        self.mesh_dims = list(mesh.mesh_dim_names or ()) if mesh is not None else []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets, indices = batch
        if self.current_epoch == 0:
            self.seen.extend(int(i) for i in indices)
        if hasattr(self, "mlp"):
            self.weight_dtype = str(self.mlp.up.weight.dtype)
            with torch.no_grad():
                self.compute_dtype = str(self.mlp.up(torch.tanh(self.embed(inputs))).dtype)
        loss = F.mse_loss(self(inputs), targets)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        # A sum over the data-parallel processes: each sample of the epoch counted once.
        rows = torch.tensor(float(len(inputs)))
        self.log("samples", rows, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", F.mse_loss(self(inputs), targets), sync_dist=True)
        self.val_seen.update(torch.ones(len(inputs)))
        self.log("val_seen", self.val_seen)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class ExpertRegression(TensorParallelRegression):
    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        add_expert_layers(self)
        self.val_seen = SumMetric()
        self.seen, self.mesh_dims = [], []
        self.weight_dtype = self.compute_dtype = ""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return run_expert_layers(self, inputs)


class Recorder(pl.Callback):
    """Full weights (a collective) when training starts, after a restore, and ends."""

    def __init__(self) -> None:
        self.start: Weights = {}
        self.end: Weights = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = full_weights(trainer)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.end = full_weights(trainer)


def layout(**sizes: int) -> SlipstreamStrategy:
    plan = PLAN if sizes.get("tp_size", 1) > 1 else None
    return SlipstreamStrategy(parallelism_config=ParallelismConfig(**sizes, tp_plan=plan))


def fit(
    strategy: Any,
    devices: int,
    epochs: int,
    ckpt_path: str | None = None,
    module: type[TensorParallelRegression] = TensorParallelRegression,
    **kwargs: Any,
) -> dict[str, Any]:
    seed()
    model = module()
    recorder = Recorder()
    callbacks = [recorder, *kwargs.pop("callbacks", [])]
    trainer = trainer_for(
        strategy, epochs, devices=devices, callbacks=callbacks, num_sanity_val_steps=0, **kwargs
    )
    train = DataLoader(indexed(regression_data()), batch_size=BATCH)
    validation = DataLoader(validation_data(), batch_size=BATCH)
    trainer.fit(model, train, validation, ckpt_path=ckpt_path)
    return {
        "trainer": trainer,
        "model": model,
        "start": recorder.start,
        "end": recorder.end,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "precision": str(trainer.precision),
        "weight_dtype": model.weight_dtype,
        "compute_dtype": model.compute_dtype,
    }


def public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in ("trainer", "model")}


def collectives(strategy: SlipstreamStrategy) -> dict[str, Any]:
    """Lightning's collective API under the layout (identical on every process)."""
    state = strategy.state
    assert state is not None
    gathered = strategy.all_gather(torch.tensor([float(state.data_parallel_index)]))
    rank = strategy.global_rank
    return {
        "all_gather": gathered.flatten().tolist(),
        "sum_of_ones": float(strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
        "all_true": strategy.reduce_boolean_decision(True, all=True),
        "all_rank0": strategy.reduce_boolean_decision(rank == 0, all=True),
        "any_rank0": strategy.reduce_boolean_decision(rank == 0, all=False),
    }


def report(out: Path, run: dict[str, Any]) -> None:
    """What this process did: its coordinates, its sampler and the samples it read."""
    trainer: pl.Trainer = run["trainer"]
    state = trainer.strategy.state
    assert state is not None and state.mesh is not None
    sampler = trainer.train_dataloader.sampler
    rank = trainer.global_rank
    info = {
        "rank": rank,
        "tp_rank": state.mesh.local_rank("tp"),
        "data_parallel_index": state.data_parallel_index,
        "sampler": [sampler.num_replicas, sampler.rank],
        "seen": run["model"].seen,
        "mesh_dims": run["model"].mesh_dims,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(info))


def checkpoint_files(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


# -- the Lightning-free reference ------------------------------------------------------------------
def global_batches(data_parallel_size: int, epoch: int) -> list[torch.Tensor]:
    """The sample indices of each global batch of ``epoch``: Lightning gives every
    data-parallel process a shuffling ``DistributedSampler`` (seed 0, set to the epoch) and
    batches of ``BATCH``; global batch ``k`` is batch ``k`` of every process together."""
    shares = []
    for rank in range(data_parallel_size):
        sampler = DistributedSampler(
            range(SAMPLES), num_replicas=data_parallel_size, rank=rank, shuffle=True, seed=0
        )
        sampler.set_epoch(epoch)
        shares.append(torch.tensor(list(sampler)).split(BATCH))
    return [torch.cat(parts) for parts in zip(*shares, strict=True)]


def reference(
    start: Weights,
    sizes: list[int],
    accumulate: int = 1,
    clip: float | None = None,
    net: type[nn.Module] = Net,
) -> Weights:
    """Plain torch on one process: the same initial weights and global batches, for one
    epoch per entry of ``sizes`` (the data-parallel size of that epoch)."""
    model = net()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict({k: torch.tensor(v).reshape(shapes[k]) for k, v in start.items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    inputs, targets = regression_data().tensors
    for epoch, data_parallel_size in enumerate(sizes):
        batches = global_batches(data_parallel_size, epoch)
        for step, indices in enumerate(batches):
            # Lightning divides the loss by accumulate_grad_batches and steps every N batches
            # (and at the end of the epoch).
            loss = F.mse_loss(model(inputs[indices]), targets[indices])
            (loss / accumulate).backward()
            if (step + 1) % accumulate and step + 1 < len(batches):
                continue
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}


def fresh_weights(module: type[nn.Module] = TensorParallelRegression) -> Weights:
    """The seeded initial weights of a new model, as every Trainer run starts from."""
    seed()
    state = module().state_dict()
    return {k: v.flatten().tolist() for k, v in state.items()}


def is_rank_zero() -> bool:
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0


# -- scenarios -----------------------------------------------------------------------------------
def scenario_tp2(out: Path) -> dict[str, Any]:
    # After epoch 1 (val_loss lower than after epoch 0) ModelCheckpoint replaces its best
    # checkpoint only if every process agrees (reduce_boolean_decision over all of them).
    best = ModelCheckpoint(dirpath=str(out / "best"), monitor="val_loss", filename="{epoch}")
    straight = fit(
        layout(tp_size=2), devices=2, epochs=2, callbacks=[best], enable_checkpointing=True
    )
    report(out, straight)
    found = collectives(straight["trainer"].strategy)
    # The same Trainer again: the sharded model is reused, not sharded a second time.
    validation = DataLoader(validation_data(), batch_size=BATCH)
    validated = straight["trainer"].validate(straight["model"], validation, verbose=False)[0]
    accumulate = fit(layout(tp_size=2), devices=2, epochs=1, **ACCUMULATE)
    bf16 = fit(layout(tp_size=2), devices=2, epochs=1, precision="bf16-mixed")
    first = fit(layout(tp_size=2), devices=2, epochs=1)
    path = str(out / "tp2.ckpt")
    first["trainer"].save_checkpoint(path)
    resumed = fit(layout(tp_size=2), devices=2, epochs=2, ckpt_path=path)
    # The same sharded checkpoint restored under another layout of the same 2 processes.
    resharded = fit(layout(dp_shard_size=2), devices=2, epochs=2, ckpt_path=path)
    result: dict[str, Any] = {
        "fresh": fresh_weights(),
        "straight": public(straight),
        "validated": validated,
        "accumulate": public(accumulate),
        "bf16": public(bf16),
        "first": public(first),
        "resumed": public(resumed),
        "resharded": public(resharded),
        "saved_files": checkpoint_files(path),
        "best": [os.path.basename(best.best_model_path), sorted(os.listdir(out / "best"))],
        "best_files": checkpoint_files(best.best_model_path),
        "collectives": found,
        "repr": repr(straight["trainer"].strategy),
    }
    if is_rank_zero():
        start = straight["start"]
        result["reference"] = reference(start, [1, 1])
        result["reference_accumulate"] = reference(start, [1], accumulate=2, clip=0.05)
        result["reference_one_epoch"] = reference(start, [1])
        # Epoch 0 under tp=2 (1 data-parallel process), epoch 1 under dp_shard=2.
        result["reference_resharded"] = reference(start, [1, 2])
    return result


def scenario_tp2_dp2(out: Path) -> dict[str, Any]:
    first = fit(layout(dp_shard_size=2, tp_size=2), devices=4, epochs=1)
    report(out, first)
    found = collectives(first["trainer"].strategy)
    path = str(out / "tp2_dp2.ckpt")
    first["trainer"].save_checkpoint(path)
    resumed = fit(layout(dp_shard_size=2, tp_size=2), devices=4, epochs=2, ckpt_path=path)
    hsdp = fit(layout(dp_replicate_size=2, dp_shard_size=2), devices=4, epochs=1)
    result: dict[str, Any] = {
        "fresh": fresh_weights(),
        "first": public(first),
        "resumed": public(resumed),
        "hsdp": public(hsdp),
        "saved_files": checkpoint_files(path),
        "collectives": found,
    }
    if is_rank_zero():
        start = first["start"]
        result["reference"] = reference(start, [2, 2])
        result["reference_hsdp"] = reference(start, [4])
    return result


def scenario_ep2(out: Path) -> dict[str, Any]:
    def experts() -> SlipstreamStrategy:
        return SlipstreamStrategy(
            parallelism_config=ParallelismConfig(ep_size=2, ep_plan=["experts"])
        )

    first = fit(experts(), devices=2, epochs=1, module=ExpertRegression)
    strategy = first["trainer"].strategy
    local = strategy.lightning_module.experts.w_in.to_local().shape
    path = str(out / "ep2.ckpt")
    first["trainer"].save_checkpoint(path)
    resumed = fit(experts(), devices=2, epochs=2, ckpt_path=path, module=ExpertRegression)
    result: dict[str, Any] = {
        "fresh": fresh_weights(ExpertRegression),
        "first": public(first),
        "resumed": public(resumed),
        "local_experts": list(local),
        "saved_files": checkpoint_files(path),
        "repr": repr(strategy),
    }
    if is_rank_zero():
        result["reference"] = reference(first["start"], [2, 2], net=ExpertNet)
    return result


if __name__ == "__main__":
    main(globals())
