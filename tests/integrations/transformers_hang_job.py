"""transformers' Trainer on slipstream that stops making progress on its last process:
after step 2 that process sleeps while the other goes on into step 3's gradient
all-reduce. With ``accelerator_options={"hang_timeout": TIMEOUT}`` the hang report names
it; the job ends with the hang exit code.

Arguments: OUT_DIR TIMEOUT. Each process writes its pid to OUT_DIR/pid-RANK, the culprit
the time it started sleeping to OUT_DIR/culprit-started.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `tests`
from tests.integrations.test_transformers import train


class Stall(transformers.TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2 and args.process_index == args.world_size - 1:
            (self.out / "culprit-started").write_text(repr(time.time()))
            time.sleep(600)  # culprit


def main() -> None:
    out, timeout = Path(sys.argv[1]), float(sys.argv[2])
    rank = int(os.environ["RANK"])
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    train(
        "slipstream",
        str(out / "trainer"),
        options={"hang_timeout": timeout},
        callbacks=[Stall(out)],
    )


if __name__ == "__main__":
    main()
