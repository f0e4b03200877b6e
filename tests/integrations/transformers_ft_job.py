"""transformers' Trainer on slipstream under ``slipstream launch --fault_tolerance``: each
replica group trains the tiny Llama of tests/integrations/test_transformers.py for at least
MAX_STEPS committed steps. Replica group 1 kills itself (SIGKILL) in its first life inside
the backward of step DIE_AT (the step is then discarded); the launcher restarts it and it
heals from the survivor. A survivor that committed a step alone trains on past MAX_STEPS
until a step has both groups again, so both groups end together at the same step.

Each run (group, life) writes OUT/replica{G}-life{L}.jsonl: one line per logged step
(``{"step", "loss", "groups", "epoch"}``: its committed step, the loss of its share of the
global batch, the groups in the step's quorum, the Trainer's epoch), the Trainer's
``train_loss``, its summary, and the refusal of ``resume_from_checkpoint`` asked after
training.

Arguments: OUT_DIR MAX_STEPS DIE_AT.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `tests`
from tests.integrations.test_transformers import tiny_llama, train


def controller() -> Any:
    from slipstream.accelerator.shared_state import latest_accelerator

    return latest_accelerator().fault_tolerance  # type: ignore[union-attr]


def wait_for(path: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class Record(transformers.TrainerCallback):
    """Writes the run's logged steps and holds the groups together where the test needs
    them: both in the first quorum, and (the job's own --until-rejoined) a survivor that
    ran a committed step alone trains on past MAX_STEPS until a step has both groups, so
    the restarted group heals and both end at the same step however slowly it restarts."""

    def __init__(self, out: Path, life: int) -> None:
        self.out, self.life = out, life
        self.replica = -1
        self.groups = 0  # in the quorum of the step under way
        self.lines: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.replica = int(controller().replica_id.rsplit("_", 1)[1])
        path = self.out / f"replica{self.replica}-life{self.life}.jsonl"
        self.lines = path.open("a", buffering=1)
        # Written once this group's manager heartbeats: the lighthouse then forms no
        # quorum without it (a quorum needs more than half of the live groups).
        (self.out / f"ready-{self.replica}-life{self.life}").write_text("")
        if self.life == 0:
            wait_for(self.out / f"ready-{1 - self.replica}-life0")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The step is open (its batches are dealt): its quorum is known.
        _, count = controller().data_coordinates()
        self.groups = count  # one process per group

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Alone, before the vote (which asks for the next quorum): wait for the restarted
        # group to start training, so that it is not left out of many quorums. Saves steps
        # only; the job is right however this wait ends.
        if self.groups < 2 and self.life == 0:
            wait_for(self.out / f"ready-{1 - self.replica}-life1")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.groups < 2 and state.global_step >= state.max_steps:
            state.max_steps = state.global_step + 1
            control.should_training_stop = False

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            line = {
                "step": state.global_step,
                "loss": logs["loss"],
                "groups": self.groups,
                "epoch": state.epoch,
            }
            self.lines.write(json.dumps(line) + "\n")
        if logs and "train_loss" in logs:
            self.lines.write(json.dumps({"train_loss": logs["train_loss"]}) + "\n")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ft = controller()
        model = kwargs["model"]
        digest = hashlib.sha256()
        for parameter in model.parameters():
            digest.update(parameter.detach().float().numpy().tobytes())
        summary = {
            "global_step": state.global_step,
            "epoch": state.epoch,
            "committed": ft.steps_committed,
            "discarded": ft.steps_discarded,
            "recoveries": ft.recoveries,
            "job_step": ft.current_step(),
            "weights": digest.hexdigest(),
        }
        self.lines.write(json.dumps({"summary": summary}) + "\n")
        self.lines.close()


def main() -> None:
    from slipstream import FaultToleranceKwargs

    out, max_steps, die_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = Record(out, life)
    model = tiny_llama()
    dying = {"armed": False}

    class Die(transformers.TrainerCallback):
        """Group 1, first life: dies inside the backward of step DIE_AT's last micro-batch,
        while the other group waits for its gradients."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            dying["armed"] = life == 0 and record.replica == 1 and state.global_step == die_at - 1

    def kill_in_backward(gradient: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return gradient

    def arm(module: Any, inputs: Any, output: torch.Tensor) -> None:
        from slipstream.accelerator.shared_state import latest_accelerator

        accelerator = latest_accelerator()
        if dying["armed"] and accelerator is not None and accelerator.sync_gradients:
            output.register_hook(kill_in_backward)

    model.lm_head.register_forward_hook(arm)

    def resume(trainer: Any) -> None:
        from slipstream.integrations.transformers import TrainerConfigurationError

        try:
            trainer.train(resume_from_checkpoint=str(out / "trainer"))
        except TrainerConfigurationError as error:
            path = out / f"replica{record.replica}-life{life}.jsonl"
            with path.open("a") as lines:
                lines.write(json.dumps({"refused": str(error)}) + "\n")

    train(
        "slipstream",
        str(out / "trainer"),
        model=model,
        options={"fault_tolerance": FaultToleranceKwargs(min_replicas=1)},
        callbacks=[record, Die()],
        gradient_accumulation_steps=2,
        samples=16,
        max_steps=max_steps,
        after=resume,
    )


if __name__ == "__main__":
    main()
