"""``slipstream migrate``: imports and commands rewritten, formatting and comments kept, names
slipstream does not provide reported with their reason, --check and --diff."""

from __future__ import annotations

import ast
import importlib
import shutil
from pathlib import Path

import pytest

from slipstream.cli import migrate
from slipstream.cli.migrate import rewrite_python, rewrite_script
from tests.distributed import run_cli, run_cli_here, run_python

pytest.importorskip("libcst")

SCRIPT = """\
# Train with Accelerate.
import accelerate  # the package itself
from accelerate import Accelerator   # odd spacing stays
from accelerate.utils import (
    set_seed,  # a comment inside the import
    MegatronLMDummyScheduler,
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
)
from accelerate.utils import (
    MegatronLMDummyScheduler,
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
    assert any(
        m.startswith("train.py:4:")
        and "`MegatronLMDummyScheduler` (accelerate.utils) is not provided" in m
        and m.endswith("kept on accelerate")
        for m in messages
    )
    assert any(
        m.startswith("train.py:3:") and "`Accelerator` (accelerate) is provided differently" in m
        for m in messages
    )
    assert any(
        m.startswith("train.py:13:") and "`lomo_backward` (Accelerator) is not provided" in m
        for m in messages
    )
    again, still = rewrite_python(EXPECTED, "train.py")
    assert again == EXPECTED, "a migrated file stays as it is"
    assert [f.line for f in still] == [7, 15], "what stays on accelerate is still reported"


SPLIT = """\
from accelerate.utils import (
    MegatronLMDummyScheduler,  # m
    set_seed,  # s
    gather
)
from accelerate.utils import (set_seed, MegatronLMDummyScheduler)
from accelerate.utils import set_seed, MegatronLMDummyScheduler, gather as g  # tail
from accelerate.utils.operations import MegatronLMDummyScheduler, not_a_name; import os
if True:
    from accelerate.data_loader import prepare_data_loader, not_in_slipstream
"""

SPLIT_EXPECTED = """\
from slipstream.utils import (
    set_seed,  # s
    gather
)
from accelerate.utils import (
    MegatronLMDummyScheduler,  # m
)
from slipstream.utils import (set_seed)
from accelerate.utils import (MegatronLMDummyScheduler)
from slipstream.utils import set_seed, gather as g  # tail
from accelerate.utils import MegatronLMDummyScheduler
from accelerate.utils.operations import MegatronLMDummyScheduler, not_a_name; import os
if True:
    from slipstream.data import prepare_data_loader
    from accelerate.data_loader import not_in_slipstream
"""


def test_an_import_is_split_when_slipstream_lacks_some_of_its_names():
    after, findings = rewrite_python(SPLIT, "split.py")
    assert after == SPLIT_EXPECTED
    compile(after, "split.py", "exec")
    kept = {
        (f.line, f.message.split("`")[1]) for f in findings if "kept on accelerate" in f.message
    }
    assert kept == {
        (1, "MegatronLMDummyScheduler"), (6, "MegatronLMDummyScheduler"), (7, "MegatronLMDummyScheduler"),
        (8, "MegatronLMDummyScheduler"), (8, "not_a_name"), (10, "not_in_slipstream"),
    }  # fmt: skip
    messages = {f.message for f in findings}
    # A name without a row is told, not passed over: kept or used unchecked.
    assert (
        "`not_a_name` (accelerate.utils.operations) is not provided by slipstream (no row "
        "in the compatibility table); kept on accelerate" in messages
    )
    assert any(
        m.startswith("`prepare_data_loader` (accelerate.data_loader) has no row") for m in messages
    )
    assert any(
        m.startswith("`gather` (accelerate.utils) is provided differently") for m in messages
    )


def test_each_accelerate_module_goes_where_slipstream_provides_its_names():
    assert migrate.candidates("accelerate.utils.operations") == ("slipstream.utils",)
    assert migrate.candidates("accelerate.data_loader") == ("slipstream.data", "slipstream")
    assert migrate.candidates("accelerate.state") == ("slipstream",)
    assert migrate.candidates("accelerate.test_utils.training") == ("slipstream.test_utils",)
    assert migrate.candidates("accelerate.hooks") == migrate.OTHER_MODULES
    assert migrate.provider("accelerate.utils.operations", "gather") == "slipstream.utils"
    assert migrate.provider("accelerate.data_loader", "prepare_data_loader") == "slipstream.data"
    assert migrate.provider("accelerate.state", "PartialState") == "slipstream"
    assert migrate.provider("accelerate.logging", "get_logger") == "slipstream.logging"
    assert migrate.provider("accelerate.utils", "MegatronLMDummyScheduler") is None
    assert migrate.provider("accelerate.commands.nothing", "merge_command") is None
    # Decided by importing: whatever a module answers is really there.
    for module, name in [
        ("accelerate.commands.merge", "merge_command"),
        ("accelerate.state", "AcceleratorState"),
        ("accelerate.data_loader", "DataLoaderDispatcher"),
        ("accelerate.test_utils", "RegressionModel"),
    ]:
        target = migrate.provider(module, name)
        assert target is None or hasattr(importlib.import_module(target), name)


CALLS = """\
import accelerate
from accelerate import Accelerator, notebook_launcher
from accelerate.utils import gather

accelerator = Accelerator(cpu=True, deepspeed_plugins=None)
notebook_launcher(print, (), 2, use_port="29501", no_such_keyword=1)
gather(x, not_a_keyword=True)
other = accelerate.Accelerator(torch_tp_plugin=None)
accelerator.unwrap_model(model, keep_torch_compile=False, keep_hooks=True)
accelerator.state
accelerator.lomo_backward(loss, 0.1)
accelerate.prepare_pippy(model)
"""


def test_keywords_and_members_slipstream_lacks_are_reported():
    after, findings = rewrite_python(CALLS, "calls.py")
    found = [(f.line, f.message) for f in findings]
    assert (5, "`Accelerator(..., deepspeed_plugins=...)`: slipstream's takes no "
            "`deepspeed_plugins`") in found  # fmt: skip
    assert (6, "`notebook_launcher(..., no_such_keyword=...)`: slipstream's takes no "
            "`no_such_keyword`") in found  # fmt: skip
    assert (7, "`gather(..., not_a_keyword=...)`: slipstream's takes no `not_a_keyword`") in found
    assert (8, "`accelerate.Accelerator(..., torch_tp_plugin=...)`: slipstream's takes no "
            "`torch_tp_plugin`") in found  # fmt: skip
    assert (9, "`accelerator.unwrap_model(..., keep_hooks=...)`: slipstream's takes no "
            "`keep_hooks`") in found  # fmt: skip
    assert not any("takes no `keep_torch_compile`" in m for _, m in found)
    assert not any("takes no `use_port`" in m for _, m in found)
    # An instance attribute is a member too (provided), but the table has no row for it.
    assert (10, "`state` (Accelerator) has no row in the compatibility table: check "
            "slipstream's") in found  # fmt: skip
    assert any(
        line == 11 and "`lomo_backward` (Accelerator) is not provided" in m for line, m in found
    )
    assert any(
        line == 12 and "`prepare_pippy` (accelerate) is not provided" in m for line, m in found
    )
    assert "other = slipstream.Accelerator(" in after


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
    result = run_cli_here("migrate", str(project), "--check", "--diff")
    assert result.returncode == 1, result.stderr
    assert (
        "would rewrite" in result.stdout and "+from slipstream import Accelerator" in result.stdout
    )
    assert (
        "src/train.py:4: `MegatronLMDummyScheduler` (accelerate.utils) is not provided"
        in result.stdout
    )
    assert (project / "src" / "train.py").read_text() == SCRIPT, "--check writes nothing"


def test_migrating_writes_the_files_then_check_passes(tmp_path: Path):
    project = _project(tmp_path / "p")
    result = run_cli_here("migrate", str(project))
    assert result.returncode == 0, result.stderr
    assert (project / "src" / "train.py").read_text() == EXPECTED
    assert (project / "Makefile").read_text() == "train:\n\tslipstream launch src/train.py\n"
    assert (project / "README.txt").read_text().startswith("accelerate launch")
    assert (project / ".venv" / "lib.py").read_text() == "import accelerate\n", "skipped"
    again = run_cli_here("migrate", str(project), "--check")
    assert again.returncode == 0 and "0 file(s) would change" in again.stdout


def test_a_missing_path_is_a_clear_error(tmp_path: Path):
    result = run_cli("migrate", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_diff_prints_the_changes_and_writes_nothing(tmp_path: Path):
    project = _project(tmp_path / "p")
    result = run_cli_here("migrate", str(project), "--diff")
    assert result.returncode == 0, result.stderr
    assert "-from accelerate import Accelerator" in result.stdout
    assert "+from slipstream import Accelerator" in result.stdout
    assert "+\tslipstream launch src/train.py" in result.stdout
    assert "would rewrite" in result.stdout and "2 file(s) would change" in result.stdout
    assert (project / "src" / "train.py").read_text() == SCRIPT, "--diff writes nothing"
    assert (project / "Makefile").read_text() == "train:\n\taccelerate launch src/train.py\n"


# -- Accelerate's own test scripts --------------------------------------------------------
def _accelerate_scripts() -> list[Path]:
    accelerate = pytest.importorskip("accelerate")
    folder = Path(accelerate.__file__).parent / "test_utils" / "scripts"
    return [*sorted(folder.glob("test_*.py")), folder / "external_deps" / "test_metrics.py"]


def _imports(source: str) -> list[tuple[str, str, str]]:
    """``(module, name, local name)`` of every ``from accelerate/slipstream... import``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "accelerate",
            "slipstream",
        ):
            found += [(node.module or "", a.name, a.asname or a.name) for a in node.names]
    return found


@pytest.mark.slow
def test_accelerates_test_scripts_import_cleanly_after_migrating(tmp_path: Path):
    scripts = _accelerate_scripts()
    for script in scripts:
        shutil.copy(script, tmp_path / script.name)
    result = run_cli_here("migrate", str(tmp_path))
    assert result.returncode == 0, result.stderr
    statements = []
    for script in scripts:
        before, after = _imports(script.read_text()), _imports((tmp_path / script.name).read_text())
        assert sorted(a[2] for a in after) == sorted(b[2] for b in before), "no name is lost"
        for module, name, _ in after:
            if module.startswith("slipstream"):
                assert hasattr(importlib.import_module(module), name), (script.name, name)
                continue
            # Left on accelerate only because slipstream really lacks it, and reported.
            assert migrate.provider(module, name) is None, (script.name, module, name)
            told = f"`{name}` ({module}) is not provided by slipstream"
            assert any(
                line.startswith(str(tmp_path / script.name)) and told in line
                for line in result.stdout.splitlines()
            ), (script.name, told)
        tree = ast.parse((tmp_path / script.name).read_text())
        statements += [
            ast.unparse(node)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slipstream")
        ]
    # The rewritten imports, all run in a fresh interpreter.
    imported = run_python("-c", "\n".join(statements))
    assert imported.returncode == 0, imported.stderr[-3000:]


MEGATRON_SCRIPT = """\
from accelerate import Accelerator
from accelerate.utils import MegatronLMPlugin, MegatronLMDummyScheduler

plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=2, gradient_clipping=1.0)
accelerator = Accelerator(megatron_lm_plugin=plugin)
"""
MEGATRON_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_num_micro_batches: 2
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: true
  megatron_lm_sequence_parallelism: false
  megatron_lm_tp_degree: 2
  megatron_lm_use_distributed_optimizer: true
num_processes: 4
use_cpu: true
"""


def test_a_megatron_project_moves_its_plugin_and_keeps_its_config_block(tmp_path: Path):
    from slipstream.launcher.config import load_config

    after, findings = rewrite_python(MEGATRON_SCRIPT, "train.py")
    assert after.splitlines()[:3] == [
        "from slipstream import Accelerator",
        "from slipstream.utils import MegatronLMPlugin",
        "from accelerate.utils import MegatronLMDummyScheduler",
    ]
    messages = [str(f) for f in findings]
    assert any(
        "`MegatronLMPlugin` (accelerate.utils) is provided differently" in m for m in messages
    )
    assert not any("takes no `megatron_lm_plugin`" in m for m in messages), "the keyword is taken"
    # The config block is read as Accelerate wrote it: migrate leaves it, launch runs it.
    config_file = tmp_path / "accelerate_cfg.yaml"
    config_file.write_text(MEGATRON_CONFIG)
    result = run_cli_here("migrate", str(tmp_path), "--check")
    assert result.returncode == 0 and "0 file(s) would change" in result.stdout, result.stdout
    config, notes = load_config(config_file)
    assert config.parallel_layout() == "pp=2 x tp=2" and notes == []
