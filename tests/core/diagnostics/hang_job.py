"""A training script that stops making progress on one process, as asked:

    hang_job.py MODE HANG_TIMEOUT PROJECT_DIR [GROUP_TIMEOUT]

MODE: ``sleep`` (the last process sleeps after step 3), ``branch`` (it calls
``wait_for_everyone`` where the others reduce), ``skip`` (it skips one ``gather`` of the
evaluation, then waits at the final barrier), ``ddp`` (it sleeps while the others are in
DDP's gradient all-reduce). Each process writes its pid, and the culprit the time it
started misbehaving, into PROJECT_DIR. GROUP_TIMEOUT (seconds) is the process group's
timeout (``InitProcessGroupKwargs``), for a hang that torch's timeout notices first.
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from slipstream import Accelerator, InitProcessGroupKwargs

mode, timeout, project = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
handlers = []
if len(sys.argv) > 4:
    handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=float(sys.argv[4]))))
accelerator = Accelerator(hang_timeout=timeout, project_dir=str(project), kwargs_handlers=handlers)
rank = accelerator.process_index
culprit = accelerator.num_processes - 1
(project / f"pid-{rank}").write_text(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def started() -> None:
    (project / "culprit-started").write_text(repr(time.time()))


for step in range(6):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if mode == "ddp" and step == 4 and rank == culprit:
        started()
        time.sleep(600)  # culprit: ddp
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step == 3 and rank == culprit and mode == "sleep":
        started()
        time.sleep(600)  # culprit: sleep
    if step == 3 and rank == culprit and mode == "branch":
        started()
        accelerator.wait_for_everyone()  # culprit: branch
    accelerator.reduce(loss.detach(), "mean")
for batch in range(5):
    if mode == "skip" and rank == culprit and batch == 2:
        started()
        continue
    accelerator.gather(torch.tensor([float(batch)]))
accelerator.wait_for_everyone()  # culprit: skip
