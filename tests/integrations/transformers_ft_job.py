"""transformers' Trainer on slipstream under ``slipstream launch --fault_tolerance``: each
replica group trains the tiny Llama of tests/integrations/test_transformers.py and writes
its logged losses to OUT/replica{N}.json.

Arguments: OUT_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `tests`
from tests.integrations.test_transformers import train


def main() -> None:
    out = Path(sys.argv[1])
    result = train("slipstream", str(out / "trainer"), gradient_accumulation_steps=2, samples=16)
    from slipstream.accelerator.shared_state import latest_accelerator

    accelerator = latest_accelerator()
    assert accelerator is not None
    controller = accelerator.fault_tolerance  # type: ignore[attr-defined]
    replica = int(controller.replica_id.rsplit("_", 1)[1])
    summary = {
        "loss": result["loss"],
        "groups": controller.replica_groups,
        "committed": controller.current_step(),
        "steps": accelerator.step,  # type: ignore[attr-defined]
    }
    (out / f"replica{replica}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
