"""transformers' Trainer on slipstream under ``slipstream launch --fault_tolerance``: each
replica group trains the tiny Llama of tests/integrations/test_transformers.py and writes
its logged losses, and the live groups of every step, to OUT/replica{N}.json.

Arguments: OUT_DIR.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `tests`
from tests.integrations.test_transformers import train


class BothGroups(transformers.TrainerCallback):
    """Holds each group at the start of training until the other group's manager exists,
    so the first quorum has both (a group that asks alone may start alone), then records
    how many data-parallel processes every step's quorum dealt the batch to."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.quorum: list[int] = []
        self.held: Any = None  # the controller, kept past the Trainer (and its Accelerator)

    def controller(self) -> Any:
        from slipstream.accelerator.shared_state import latest_accelerator

        if self.held is None:
            self.held = latest_accelerator().fault_tolerance  # type: ignore[union-attr]
        return self.held

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        (self.out / f"ready-{self.controller().replica_id}").write_text("")
        deadline = time.monotonic() + 60
        while len(list(self.out.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.quorum.append(self.controller().data_coordinates()[1])


def main() -> None:
    from slipstream import FaultToleranceKwargs

    out = Path(sys.argv[1])
    watch = BothGroups(out)
    # slipstream's own option object, passed through the Trainer.
    options = {"fault_tolerance": FaultToleranceKwargs(min_replicas=1)}
    result = train(
        "slipstream",
        str(out / "trainer"),
        options=options,
        callbacks=[watch],
        gradient_accumulation_steps=2,
        samples=16,
    )
    controller = watch.controller()
    replica = int(controller.replica_id.rsplit("_", 1)[1])
    summary = {
        "loss": result["loss"],
        "quorum": watch.quorum,
        "groups": controller.replica_groups,
        "committed": controller.steps_committed,
        "steps": controller.current_step(),
    }
    (out / f"replica{replica}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
