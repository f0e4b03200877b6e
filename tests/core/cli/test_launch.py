"""`slipstream launch`'s parallelism flags: help, merging over the file's block, errors before
anything is spawned, and a configuration error raised inside the workers."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from slipstream.cli import build_parser
from slipstream.cli.launch import resolve_config
from slipstream.launcher.config import ConfigError
from tests.distributed import REPO, run_cli, run_cli_here

FLAGS = (
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "pp_size",
    "cp_comm_strategy",
    "sequence_parallel",
    "tp_plan",
)

# Writes what its worker was told (the launch configuration's block) and the mesh it built.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    from slipstream import Accelerator

    accelerator = Accelerator()
    mesh = accelerator.torch_device_mesh
    report = {
        "block": accelerator.state.launch.launch_config["parallelism_config"],
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)) if mesh is not None else None,
        "tp_rank": accelerator.tensor_parallel_rank,
    }
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    """
)


def parse(*arguments: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *arguments, "train.py"])


def test_help_has_a_group_with_every_parallelism_flag():
    result = run_cli_here("launch", "--help")
    assert result.returncode == 0, result.stderr
    group = result.stdout.split("N-D parallelism", 1)[1].split("what to run:", 1)[0]
    for flag in FLAGS:
        assert f"--parallelism_config_{flag}" in group
        assert f"--parallelism-config-{flag.replace('_', '-')}" in group
    assert "--use_parallelism_config" in group


def test_flags_fill_the_block_and_both_spellings_work():
    config, _ = resolve_config(
        parse(
            "-n", "8", "--cpu", "--use_parallelism_config",
            "--parallelism_config_dp_replicate_size", "2", "--parallelism-config-dp-shard-size",
            "-1", "--parallelism_config_cp_size", "1", "--parallelism-config-tp-size", "2",
            "--parallelism_config_pp_size", "1", "--parallelism_config_cp_comm_strategy",
            "alltoall", "--parallelism_config_sequence_parallel", "true",
        )
    )  # fmt: skip
    assert config.parallelism_config == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": -1,
        "parallelism_config_cp_size": 1,
        "parallelism_config_tp_size": 2,
        "parallelism_config_pp_size": 1,
        "parallelism_config_cp_comm_strategy": "alltoall",
        "parallelism_config_sequence_parallel": "true",
    }
    assert config.parallel_layout() == "dp_replicate=2 x dp_shard=2 x tp=2"
    assert config.worker_settings()["parallelism_config"] == config.parallelism_config
    assert config.distributed_type == "MULTI_CPU"


def test_the_scripts_own_flags_are_never_read_as_abbreviations_of_the_launchers():
    # --save is a prefix of --save_on_preemption (and --n of --num_processes / --no_python).
    args = build_parser().parse_args(
        ["launch", "-n", "2", "train.py", "--save", "w.pt", "--n", "3", "--debug"]
    )
    assert args.training_script_args == ["--save", "w.pt", "--n", "3", "--debug"]
    assert args.save_on_preemption is None and args.num_processes == 2 and args.debug is None


def test_use_parallelism_config_alone_asks_for_nothing():
    config, _ = resolve_config(parse("-n", "2", "--cpu", "--use_parallelism_config"))
    assert config.parallelism_config == {} and config.parallel_layout() is None


def test_a_flag_can_fix_the_files_layout_and_otherwise_the_file_is_named(tmp_path: Path):
    path = tmp_path / "nd.yaml"
    path.write_text(
        "num_processes: 2\nuse_cpu: true\nparallelism_config:\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    )
    config, _ = resolve_config(parse("--config_file", str(path), "-n", "4"))
    assert config.parallel_layout() == "dp_shard=2 x tp=2"
    config, _ = resolve_config(
        parse("--config_file", str(path), "--parallelism_config_dp_shard_size", "1")
    )
    assert config.parallel_layout() == "tp=2"
    with pytest.raises(ConfigError) as raised:
        resolve_config(parse("--config_file", str(path), "--parallelism_config_cp_size", "2"))
    assert str(raised.value).startswith(f"{path}: parallelism_config: ")


def test_flags_merge_over_the_file_and_the_workers_build_that_mesh(tmp_path: Path):
    # The file's layout is for 4 processes; the flags make it fit 2 and keep the file's plan.
    config = tmp_path / "nd.yaml"
    plan = {"proj": "colwise"}
    config.write_text(
        yaml.safe_dump(
            {
                "distributed_type": "MULTI_CPU",
                "num_processes": 4,
                "use_cpu": True,
                "parallelism_config": {
                    "parallelism_config_dp_shard_size": 2,
                    "parallelism_config_tp_size": 2,
                    "parallelism_config_tp_plan": plan,
                },
            }
        )
    )
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(
        "launch", "--config_file", str(config), "-n", "2",
        "--parallelism_config_dp_shard_size", "1", str(script), str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    expected = {
        "parallelism_config_dp_shard_size": 1,
        "parallelism_config_tp_size": 2,
        "parallelism_config_tp_plan": plan,
    }
    assert [r["block"] for r in reports] == [expected, expected]
    assert [r["tp_rank"] for r in reports] == [0, 1]
    assert all(r["mesh"] is not None and r["mesh"].get("tp") == 2 for r in reports), reports


@pytest.mark.parametrize(
    "arguments,message",
    [
        (
            ["-n", "2", "--parallelism_config_dp_shard_size", "2",
             "--parallelism_config_tp_size", "2"],
            "slipstream launch: error: options: parallelism_config: "
            "parallelism_config_dp_shard_size=2 x parallelism_config_tp_size=2 does not fit "
            "num_processes=2",
        ),
        (
            ["-n", "4", "--parallelism-config-tp-size", "3", "--parallelism-config-dp-shard-size",
             "-1"],
            "parallelism_config_dp_shard_size=-1 x parallelism_config_tp_size=3 does not fit "
            "num_processes=4",
        ),
        (
            ["-n", "2", "--use_deepspeed", "--parallelism_config_tp_size", "2"],
            "parallelism_config_tp_size=2 cannot be combined with DeepSpeed",
        ),
        (
            ["-n", "4", "--zero_stage", "2", "--parallelism_config_dp_replicate_size", "2",
             "--parallelism_config_dp_shard_size", "2"],
            "parallelism_config_dp_replicate_size=2, parallelism_config_dp_shard_size=2 cannot "
            "be combined with DeepSpeed",
        ),
        (
            ["-n", "2", "--parallelism_config_tp_size", "0"],
            "parallelism_config_tp_size must be a positive integer",
        ),
        (
            ["-n", "2", "--parallelism_config_cp_comm_strategy", "ring"],
            "Invalid parallelism_config_cp_comm_strategy: ring; use one of allgather, alltoall",
        ),
        (
            ["-n", "2", "--parallelism_config_sequence_parallel", "maybe"],
            "parallelism_config_sequence_parallel must be true or false",
        ),
        (
            ["--config_file", "{file}", "--parallelism_config_tp_size", "2"],
            "{file}: parallelism_config: unknown key 'parallelism_config_dp_shrad_size' (did "
            "you mean 'parallelism_config_dp_shard_size'?)",
        ),
        (
            ["--config_file", "{deepspeed}", "-n", "2", "--parallelism_config_tp_size", "2"],
            "parallelism_config_tp_size=2 cannot be combined with DeepSpeed (distributed_type: "
            "DEEPSPEED)",
        ),
    ],
    ids=[
        "product", "rest", "deepspeed-tp", "deepspeed-block-hsdp", "zero", "comm-strategy",
        "sequence-parallel", "file-unknown-key", "file-deepspeed",
    ],
)  # fmt: skip
def test_a_bad_layout_exits_2_with_one_line_and_spawns_nothing(
    tmp_path: Path, arguments: list[str], message: str
):
    marker = tmp_path / "spawned"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\nprint('should not run')\n")
    paths = {"file": tmp_path / "typo.yaml", "deepspeed": tmp_path / "ds.yaml"}
    paths["file"].write_text(
        "num_processes: 2\nparallelism_config:\n  parallelism_config_dp_shrad_size: 2\n"
    )
    paths["deepspeed"].write_text("distributed_type: DEEPSPEED\nnum_processes: 2\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli_here("launch", "--cpu", *[a.format(**paths) for a in arguments], str(script))
    assert result.returncode == 2, result.stderr
    assert message.format(**paths) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not marker.exists() and "should not run" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing was written"


@pytest.mark.slow
def test_a_config_error_inside_the_workers_ends_the_launch_with_exit_code_2():
    script = REPO / "tests" / "core" / "cli" / "tp_plan_does_not_divide.py"
    result = run_cli("launch", "--num_processes", "2", "--cpu", str(script), timeout=120)
    assert result.returncode == 2, result.stderr
    assert (
        "ParallelismConfigError: tp_size=2 does not divide the 3 output features of proj"
        in result.stderr
    )
    assert "prepared a model" not in result.stdout


# A model with no tensor-parallel plan of its own; the layout comes from the launch flags.
PLANLESS = textwrap.dedent(
    """
    from torch import nn
    from slipstream import Accelerator

    accelerator = Accelerator()
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
    accelerator.print(f"prepared on {accelerator.parallelism_config.sizes.describe()}")
    """
)


@pytest.mark.slow
def test_the_tensor_parallel_plan_can_come_from_a_flag(tmp_path: Path):
    """Asked for tp by a flag, the missing-plan error names the flag and the config key that
    give a plan, not only ParallelismConfig(tp_plan=...); and that flag works."""
    script = tmp_path / "planless.py"
    script.write_text(PLANLESS)
    flags = ["launch", "-n", "2", "--cpu", "--parallelism_config_tp_size", "2"]
    missing = run_cli(*flags, str(script), timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert "has no tensor-parallel plan: pass ParallelismConfig(tp_plan=" in missing.stderr
    assert "the parallelism_config key parallelism_config_tp_plan" in missing.stderr
    assert "slipstream launch --parallelism_config_tp_plan 'mlp.up=colwise" in missing.stderr
    planned = run_cli(
        *flags, "--parallelism_config_tp_plan", "0=colwise,2=rowwise", str(script), timeout=120
    )
    assert planned.returncode == 0, planned.stderr
    assert "prepared on tp=2" in planned.stdout


def test_a_tp_plan_flag_is_read_as_pattern_style_pairs():
    config, _ = resolve_config(
        parse(
            "-n", "4", "--parallelism_config_tp_plan", "blocks.*.up=colwise, blocks.*.down=rowwise"
        )
    )
    from slipstream import ParallelismConfig

    parallel = ParallelismConfig.from_config(config.parallelism_config)
    assert parallel.tp_plan == {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    with pytest.raises(ConfigError, match=r"'blocks\.up' has unknown style 'colwide'"):
        resolve_config(parse("-n", "2", "--parallelism_config_tp_plan", "blocks.up=colwide"))
    with pytest.raises(
        ConfigError, match=r"on the command line 'mlp\.up=colwise,mlp\.down=rowwise'"
    ):
        resolve_config(parse("-n", "2", "--parallelism_config_tp_plan", "colwise"))


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["launch", "--num_proceses", "2", "train.py"], "--num_proceses (did you mean --num_processes?)"),
        (["launch", "--mixed-precison=bf16", "t.py"], "--mixed-precison=bf16 (did you mean --mixed-precision?)"),
        (["launch", "--parallelism_config_tp_szie", "2", "t.py"], "(did you mean --parallelism_config_tp_size?)"),
        (["config", "--default"], "--default (did you mean 'slipstream config default'?)"),
        (["config", "validate", "x.yaml", "--verbose"], "unrecognized arguments: --verbose"),
        (["estimate-memory", "m:f", "--tp-sise", "2"], "--tp-sise 2 (did you mean --tp-size?)"),
        (["migrate", "--chek", "."], "--chek (did you mean --check?)"),
        (["env", "--config-flie", "c.yaml"], "--config-flie c.yaml (did you mean --config-file?)"),
    ],
)  # fmt: skip
def test_a_mistyped_flag_is_answered_with_the_nearest_one(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    from slipstream.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    # The subcommand's own usage and name, not the top-level "slipstream [-h] COMMAND".
    command = " ".join(arguments[:2] if arguments[1] == "validate" else arguments[:1])
    assert f"slipstream {command}: error: unrecognized arguments: " in error, error
    assert message in error, error
    if command == "launch":
        assert len(error.strip().splitlines()) == 2, "a short usage, not all 60 launch flags"


@pytest.mark.parametrize("arguments", [["launch"], ["launch", "--cpu", "-n", "2"]])
def test_a_launch_without_a_script_says_where_the_script_goes(
    arguments: list[str], capsys: pytest.CaptureFixture[str]
):
    from slipstream.cli import main

    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "slipstream launch: error: name the script to run after the flags" in error
    assert "training_script_args" not in error


def test_flags_after_the_script_belong_to_the_script(tmp_path: Path):
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n")
    result = run_cli("launch", "-n", "1", "--cpu", str(script), "--num_proceses", "2")
    assert result.returncode == 0, result.stderr
    assert "['--num_proceses', '2']" in result.stdout
