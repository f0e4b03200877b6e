"""``slipstream launch``'s Megatron-LM flags (Accelerate's ``--use_megatron_lm`` and
``--megatron_lm_*``): they fill the ``megatron_lm_config`` block key by key over the config
file, are checked like the file's keys before anything starts, and the launcher names the
keys that have no equivalent."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import pytest

from slipstream.cli import build_parser
from slipstream.cli.launch import resolve_config
from slipstream.cli.migrate import rewrite_script
from slipstream.launcher.config import ConfigError
from slipstream.launcher.megatron_config import LAUNCH_FLAGS
from tests.distributed import run_cli

FILE = (
    "distributed_type: MEGATRON_LM\nnum_processes: 4\nuse_cpu: true\nmegatron_lm_config:\n"
    "  megatron_lm_tp_degree: 2\n  megatron_lm_pp_degree: 2\n  megatron_lm_num_micro_batches: 2\n"
    "  megatron_lm_gradient_clipping: 0.5\n"
)


def parse(*arguments: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *arguments, "train.py"])


def _launch_parser() -> argparse.ArgumentParser:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices["launch"]


def test_the_flags_are_accelerates():
    accelerate_launch = pytest.importorskip("accelerate.commands.launch")
    theirs = {
        a.dest
        for a in accelerate_launch.launch_command_parser()._actions
        if "megatron_lm" in a.dest
    }
    ours = {a.dest for a in _launch_parser()._actions if "megatron_lm" in a.dest}
    assert ours == theirs and "use_megatron_lm" in ours and len(ours) == len(LAUNCH_FLAGS) + 1


def test_flags_fill_the_block_and_both_spellings_work():
    config, notes = resolve_config(
        parse(
            *("-n", "8", "--cpu", "--use_megatron_lm", "--megatron_lm_tp_degree", "2"),
            *("--megatron-lm-pp-degree", "2", "--megatron_lm_num_micro_batches", "4"),
            *("--megatron_lm_sequence_parallelism", "true"),
            *("--megatron_lm_use_distributed_optimizer", "True"),
            *("--megatron_lm_recompute_activations", "false"),
            *("--megatron_lm_gradient_clipping", "0"),
        )
    )
    assert config.distributed_type == "MEGATRON_LM" and notes == []
    assert config.megatron_lm_config == {
        "megatron_lm_tp_degree": 2,
        "megatron_lm_pp_degree": 2,
        "megatron_lm_num_micro_batches": 4,
        "megatron_lm_sequence_parallelism": "true",
        "megatron_lm_use_distributed_optimizer": "True",
        "megatron_lm_recompute_activations": "false",
        "megatron_lm_gradient_clipping": 0.0,
    }
    assert config.parallel_layout() == "pp=2 x dp_shard=2 x tp=2"
    assert config.worker_settings()["megatron_lm_config"] == config.megatron_lm_config


def test_the_switch_alone_is_accelerates_defaults_and_a_flag_alone_is_enough():
    switch, _ = resolve_config(parse("-n", "2", "--cpu", "--use_megatron_lm"))
    assert (switch.distributed_type, switch.megatron_lm_config) == ("MEGATRON_LM", {})
    assert switch.parallel_layout() == "dp_replicate=2"
    flag, _ = resolve_config(parse("-n", "2", "--cpu", "--megatron_lm_tp_degree", "2"))
    assert flag.parallel_layout() == "tp=2"


def test_flags_override_the_file_key_by_key_and_can_fix_it(tmp_path: Path):
    path = tmp_path / "accelerate_cfg.yaml"
    path.write_text(FILE)
    config, _ = resolve_config(
        parse("--config_file", str(path), "-n", "8", "--megatron_lm_pp_degree", "1")
    )
    assert config.megatron_lm_config == {
        "megatron_lm_tp_degree": 2,
        "megatron_lm_pp_degree": 1,
        "megatron_lm_num_micro_batches": 2,
        "megatron_lm_gradient_clipping": 0.5,
    }
    assert config.parallel_layout() == "dp_replicate=4 x tp=2"
    path.write_text(FILE.replace("num_processes: 4", "num_processes: 6"))
    fixed, _ = resolve_config(parse("--config_file", str(path), "--megatron_lm_tp_degree", "3"))
    assert fixed.parallel_layout() == "pp=2 x tp=3"
    with pytest.raises(ConfigError) as raised:  # a flag that fixes nothing: the file is named
        resolve_config(parse("--config_file", str(path), "--megatron_lm_gradient_clipping", "1"))
    assert str(raised.value).startswith(f"{path}: megatron_lm_config: megatron_lm_tp_degree=2")


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["-n", "3", "--megatron_lm_tp_degree", "2"],
            "options: megatron_lm_config: megatron_lm_tp_degree=2 do not divide num_processes=3",
        ),
        (
            ["-n", "2", "--megatron_lm_tp_degree", "0"],
            "options: megatron_lm_config: megatron_lm_tp_degree must be a positive integer, got 0",
        ),
        (
            ["-n", "2", "--megatron_lm_sequence_parallelism", "maybe"],
            "megatron_lm_config: megatron_lm_sequence_parallelism must be true or false, got "
            "'maybe'",
        ),
        (
            ["-n", "2", "--megatron_lm_gradient_clipping", "-1"],
            "megatron_lm_config: megatron_lm_gradient_clipping must be >= 0",
        ),
        (
            ["-n", "2", "--use_megatron_lm", "--parallelism_config_tp_size", "2"],
            "options: megatron_lm_config and parallelism_config both describe the layout",
        ),
        (
            ["-n", "2", "--megatron_lm_tp_degree", "2", "--zero_stage", "2"],
            "options: megatron_lm_config cannot be combined with DeepSpeed",
        ),
    ],
    ids=["sizes", "degree", "bool", "clipping", "two-layouts", "deepspeed"],
)
def test_bad_flags_are_refused_naming_the_key(flags: list[str], message: str):
    with pytest.raises(ConfigError) as raised:
        resolve_config(parse("--cpu", *flags))
    assert message in str(raised.value)


def test_a_bad_flag_exits_2_before_anything_starts(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exited:
        parse("--megatron_lm_pp_degree", "x")
    assert exited.value.code == 2
    assert "--megatron-lm-pp-degree: invalid int value: 'x'" in capsys.readouterr().err
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    flags = ("-n", "3", "--cpu", "--use_megatron_lm", "--megatron_lm_tp_degree", "2")
    args = build_parser().parse_args(["launch", *flags, str(script)])
    with pytest.raises(ConfigError, match="megatron_lm_tp_degree=2 do not divide num_processes=3"):
        args.run(args)  # the command's ConfigError: one line, exit code 2
    assert not marker.exists()


def test_the_launcher_names_the_ignored_keys_in_one_note(tmp_path: Path, capsys):
    _, notes = resolve_config(
        parse(
            *("-n", "2", "--cpu", "--megatron_lm_hidden_dropout", "0.1"),
            *("--megatron_lm_no_load_optim", "true", "--megatron_lm_eod_mask_loss", "false"),
        )
    )
    assert notes == [
        "megatron_lm_config: megatron_lm_no_load_optim, megatron_lm_hidden_dropout have no "
        "slipstream equivalent and are ignored (they steer Megatron-LM's own trainer, models, "
        "scheduler or logging; see docs/megatron.md)"
    ]
    path = tmp_path / "f.yaml"
    path.write_text(FILE + "  megatron_lm_train_iters: 100\n")
    validate = build_parser().parse_args(["config", "validate", str(path)])
    assert validate.run(validate) == 0
    assert "note: megatron_lm_config: megatron_lm_train_iters has no slipstream equivalent" in (
        capsys.readouterr().out
    )


def test_help_has_a_megatron_group():
    text = _launch_parser().format_help()
    group = text.split("Megatron-LM (", 1)[1].split("what to run:", 1)[0]
    for flag in ("use_megatron_lm", "megatron_lm_tp_degree", "megatron_lm_gradient_clipping"):
        assert f"--{flag}" in group and f"--{flag.replace('_', '-')}" in group


def test_migrate_turns_a_megatron_launch_into_one_slipstream_takes():
    line = (
        "accelerate launch --use_megatron_lm --megatron_lm_tp_degree 2 "
        "--megatron_lm_pp_degree 2 --num_processes 4 --cpu train.py --lr 1\n"
    )
    after = rewrite_script(line)
    assert after == line.replace("accelerate launch", "slipstream launch")
    args = build_parser().parse_args(after.split()[1:])
    config, _ = resolve_config(args)
    assert config.parallel_layout() == "pp=2 x tp=2" and args.training_script_args == ["--lr", "1"]


# The workers get the block the flags built.
PROBE = textwrap.dedent(
    """
    from slipstream import Accelerator

    accelerator = Accelerator()
    plugin = accelerator.megatron_lm_plugin
    accelerator.print(f"tp_degree={plugin.tp_degree} clipping={plugin.gradient_clipping}")
    """
)


@pytest.mark.slow
def test_the_workers_run_the_layout_the_flags_give(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = run_cli(
        *("launch", "-n", "2", "--cpu", "--use_megatron_lm", "--megatron_lm_tp_degree", "2"),
        *("--megatron_lm_gradient_clipping", "0.25", "--megatron_lm_hidden_dropout", "0.1"),
        str(script),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tp_degree=2 clipping=0.25" in result.stdout
    assert result.stdout.count("megatron_lm_hidden_dropout has no slipstream equivalent") == 1
