"""Launched by tests/core/cli/test_launch.py: a tensor-parallel plan that cannot split its
model (tp_size=2 and a Linear with 3 output features), so every worker raises
ParallelismConfigError, a ConfigError, and ``slipstream launch`` must exit with code 2."""

from __future__ import annotations

import torch
from torch import nn

from slipstream import Accelerator, ParallelismConfig


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def main() -> None:
    config = ParallelismConfig(tp_size=2, tp_plan={"proj": "colwise"})
    accelerator = Accelerator(parallelism_config=config)
    accelerator.prepare(Tiny())
    print("prepared a model that tp_size=2 cannot split")


if __name__ == "__main__":
    main()
