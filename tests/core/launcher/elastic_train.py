"""The training script of the elastic-size tests (run by ``slipstream launch``).

Usage: ``elastic_train.py PROJECT_DIR BUDGET_FILE``. It resumes from the latest checkpoint
in PROJECT_DIR, then takes optimizer steps while the number in BUDGET_FILE is above the
step count, saving a checkpoint and the weights after each one; between steps every
process polls the budget in a collective, which also notices a lost peer. Rank 0 appends
what happened to PROJECT_DIR/log.jsonl.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator
from slipstream.utils import ProjectConfiguration

project, budget_file = sys.argv[1], sys.argv[2]
accelerator = Accelerator(
    project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(1)
inputs = torch.randn(96, 4, generator=generator)
loader = DataLoader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
resumed = accelerator.load_state("latest")
world = accelerator.num_processes


def note(**event: object) -> None:
    if accelerator.is_main_process:
        with open(os.path.join(project, "log.jsonl"), "a") as log:
            log.write(json.dumps({"world": world, "pid": os.getpid(), **event}) + "\n")


def may_continue(step: int) -> bool:
    """Whether every process sees a budget above ``step`` (a collective)."""
    try:
        with open(budget_file) as handle:
            budget = int(handle.read().strip() or 0)
    except (OSError, ValueError):
        budget = 0
    flag = torch.tensor([1 if budget > step else 0])
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


step = accelerator.step_state.optimizer_steps
note(event="start", step=step, accumulation=accelerator.gradient_accumulation_steps,
     resumed=resumed is not None)  # fmt: skip
while not may_continue(step):
    time.sleep(0.05)
for x, y in loader:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if not accelerator.sync_gradients:
        continue
    step += 1
    accelerator.save_state()
    weights = accelerator.get_state_dict(model)  # whole tensors, also from FSDP2's shards
    if accelerator.is_main_process:
        torch.save(weights, os.path.join(project, f"weights_{step}.pt"))
    note(event="step", step=step)
    if step >= int(os.environ.get("ELASTIC_TEST_STEPS", "9")):
        break
    while not may_continue(step):
        time.sleep(0.05)
note(event="done", step=step)
accelerator.end_training()
