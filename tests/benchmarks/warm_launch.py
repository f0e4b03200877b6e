"""Benchmark smoke runs on the suite's warm workers.

A benchmark's main process starts its ranks through ``workers.run_workers`` (benchmarks/
workers.py). In the suite's smoke runs, :func:`launch_on_warm_workers` stands in for the
part that starts processes: each rank runs the same script with the same arguments, forked
from a warm worker (tests/warm_workers.py) instead of a new interpreter, so a smoke run pays
for its work rather than for importing torch in every rank. The process-starting part itself
is tested on its own (tests/benchmarks/test_benchmarks.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys

from tests.distributed import run_distributed


def run_script_rank(command: list[str]) -> str:
    """One rank: run ``command`` (``[python, script, *arguments]``) as ``__main__``; returns
    what it printed."""
    script = command[1]
    sys.argv = command[1:]
    sys.path.insert(0, os.path.dirname(script))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
    return printed.getvalue()


def launch_on_warm_workers(
    command: list[str], processes: int, env: dict[str, str]
) -> tuple[str, str]:
    """``workers._launch``'s contract: every rank's stdout, and stderr (a failing rank's
    traceback fails the test instead). The memory benchmarks' allocator setting
    (``MALLOC_*``, read when a process starts) is left out: a smoke run asserts no figure, and
    with it every rank would start a fresh interpreter."""
    env = {key: value for key, value in env.items() if not key.startswith("MALLOC_")}
    outputs = run_distributed(run_script_rank, command, world_size=processes, env=env, timeout=300)
    return "".join(outputs), ""
