"""A Lightning fit on 2 spawned CPU processes whose training step writes the process id and
waits forever (the lifecycle test kills the Trainer's process underneath it)."""

from __future__ import annotations

import os
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.lightning import SlipstreamStrategy


class Parked(pl.LightningModule):
    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        with open(os.path.join(self.folder, f"worker_{self.global_rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        while True:
            time.sleep(0.1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = pl.Trainer(
        strategy=SlipstreamStrategy(start_method=sys.argv[2]),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Parked(sys.argv[1]), data)
