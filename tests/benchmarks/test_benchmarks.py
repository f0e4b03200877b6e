"""Every benchmark runs in its quick mode (no timing is asserted here)."""

from __future__ import annotations

import pytest

from tests.distributed import REPO, run_python

# run.py runs all of them (workers.py is their shared launcher); each script is smoke-tested
# on its own here.
SCRIPTS = sorted(
    p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in {"run.py", "workers.py"}
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quickly(script):
    result = run_python(str(REPO / "benchmarks" / script), "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ratio" in result.stdout
