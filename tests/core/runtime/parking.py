"""Worker functions that write their process id and wait forever (lifecycle tests)."""

from __future__ import annotations

import os
import time


def park(folder: str) -> None:
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(folder, f"worker_{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    while True:
        time.sleep(0.1)
