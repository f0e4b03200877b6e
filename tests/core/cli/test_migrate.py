"""``slipstream migrate``: imports and commands rewritten, formatting and comments kept, names
slipstream does not provide reported with their reason, --check and --diff."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.cli.migrate import rewrite_python, rewrite_script
from tests.distributed import run_cli

pytest.importorskip("libcst")

SCRIPT = """\
# Train with Accelerate.
import accelerate  # the package itself
from accelerate import Accelerator   # odd spacing stays
from accelerate.utils import (
    set_seed,  # a comment inside the import
    MegatronLMPlugin,
)
from accelerate.logging import get_logger
from accelerate.state import PartialState
import accelerate.utils as au

accelerator = Accelerator(mixed_precision="bf16")
accelerator.lomo_backward(loss, 0.1)
print(accelerate.__version__, au.set_seed)
"""

EXPECTED = """\
# Train with Accelerate.
import slipstream  # the package itself
from slipstream import Accelerator   # odd spacing stays
from slipstream.utils import (
    set_seed,  # a comment inside the import
    MegatronLMPlugin,
)
from slipstream.logging import get_logger
from slipstream import PartialState
import slipstream.utils as au

accelerator = Accelerator(mixed_precision="bf16")
accelerator.lomo_backward(loss, 0.1)
print(slipstream.__version__, au.set_seed)
"""


def test_python_imports_are_rewritten_keeping_the_formatting():
    after, findings = rewrite_python(SCRIPT, "train.py")
    assert after == EXPECTED
    messages = [str(f) for f in findings]
    assert any(m.startswith("train.py:4:") and "`MegatronLMPlugin`" in m for m in messages)
    assert any(m.startswith("train.py:9:") and "`accelerate.state`" in m for m in messages)
    assert any(
        m.startswith("train.py:13:") and "`lomo_backward` (Accelerator) is not provided" in m
        for m in messages
    )
    again, still = rewrite_python(EXPECTED, "train.py")
    assert again == EXPECTED, "a migrated file stays as it is"
    assert [f.line for f in still] == [13], "the unprovided member is still reported"


def test_commands_in_scripts_makefiles_and_ci_files():
    script = (
        "accelerate launch --num_processes 2 train.py\n"
        "accelerate config default\n"
        "python -m accelerate.commands.launch train.py\n"
        "pip install accelerate  # not a command\n"
        "my-accelerate launch\n"
    )
    assert rewrite_script(script) == (
        "slipstream launch --num_processes 2 train.py\n"
        "slipstream config default\n"
        "slipstream launch train.py\n"
        "pip install accelerate  # not a command\n"
        "my-accelerate launch\n"
    )


def _project(folder: Path) -> Path:
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "train.py").write_text(SCRIPT)
    (folder / "Makefile").write_text("train:\n\taccelerate launch src/train.py\n")
    (folder / "README.txt").write_text("accelerate launch is not touched here\n")
    (folder / ".venv").mkdir()
    (folder / ".venv" / "lib.py").write_text("import accelerate\n")
    return folder


def test_check_changes_nothing_and_fails_when_something_would_change(tmp_path: Path):
    project = _project(tmp_path / "p")
    result = run_cli("migrate", str(project), "--check", "--diff")
    assert result.returncode == 1, result.stderr
    assert (
        "would rewrite" in result.stdout and "+from slipstream import Accelerator" in result.stdout
    )
    assert "src/train.py:4: `MegatronLMPlugin` (accelerate.utils) is not provided" in result.stdout
    assert (project / "src" / "train.py").read_text() == SCRIPT, "--check writes nothing"


def test_migrating_writes_the_files_then_check_passes(tmp_path: Path):
    project = _project(tmp_path / "p")
    result = run_cli("migrate", str(project))
    assert result.returncode == 0, result.stderr
    assert (project / "src" / "train.py").read_text() == EXPECTED
    assert (project / "Makefile").read_text() == "train:\n\tslipstream launch src/train.py\n"
    assert (project / "README.txt").read_text().startswith("accelerate launch")
    assert (project / ".venv" / "lib.py").read_text() == "import accelerate\n", "skipped"
    again = run_cli("migrate", str(project), "--check")
    assert again.returncode == 0 and "0 file(s) would change" in again.stdout


def test_a_missing_path_is_a_clear_error(tmp_path: Path):
    result = run_cli("migrate", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "does not exist" in result.stderr
