"""`slipstream config` (questionnaire, default, validate), `env`, `test`, and config files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slipstream.launcher.config import load_config, save_config
from slipstream.utils import write_basic_config
from tests.distributed import run_cli, run_cli_here

FIXTURES = Path(__file__).parent / "accelerate_configs"


def answer(config_file: Path, lines: list[str], extra_env: dict | None = None):
    env = {"SLIPSTREAM_CONFIG_FILE": str(config_file.parent / "unused.yaml")}
    return run_cli_here(
        "config",
        "--config_file",
        str(config_file),
        input="\n".join(lines) + "\n",
        env={**env, **(extra_env or {})},
    )


def test_questionnaire_for_fsdp_on_cpu_processes(tmp_path):
    target = tmp_path / "answers.yaml"
    result = answer(
        target,
        [
            "",  # compute environment [LOCAL_MACHINE]
            "multi-CPU",
            "1",  # machines
            "no",  # dynamo
            "no",  # DeepSpeed
            "yes",  # FSDP
            "",  # wrap policy [TRANSFORMER_BASED_WRAP]
            "Block,Layer",
            "",  # reshard after forward [YES]
            "",  # offload [NO]
            "FULL_STATE_DICT",
            "y",  # activation checkpointing
            "2",  # processes per machine
            "",  # parallelism config [NO]
            "bf16",
        ],
    )
    assert result.returncode == 0, result.stderr
    assert f"configuration saved at {target}" in result.stdout
    assert "[LOCAL_MACHINE]" in result.stdout and "[yes/NO]" in result.stdout
    config, _ = load_config(target)
    assert (config.distributed_type, config.num_processes, config.use_cpu) == ("FSDP", 2, True)
    assert config.mixed_precision == "bf16"
    assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block,Layer"
    assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert config.fsdp_config["fsdp_activation_checkpointing"] is True


def test_questionnaire_asks_again_after_bad_answers(tmp_path):
    target = tmp_path / "again.yaml"
    result = answer(
        target,
        [
            "",
            "banana",  # not a machine type
            "2",  # by number: multi-GPU
            "zero",  # not a number
            "2",  # machines
            "5",  # rank out of range for 2 machines
            "1",
            "10.0.0.1",
            "70000",  # port out of range
            "29400",
            "",  # rendezvous [c10d]
            "maybe",  # not yes/no
            "yes",  # dynamo
            "turbo",  # unknown backend
            "eager",
            "no",
            "no",
            "4",
            "no",  # Megatron-LM
            "no",  # parallelism config
            "fp17",
            "fp16",
        ],
    )
    assert result.returncode == 0, result.stderr
    for complaint in (
        "'banana' is not one of: no, multi-CPU, multi-GPU",
        "'zero' is not a whole number",
        "5 is out of range (between 0 and 1)",
        "70000 is out of range",
        "'maybe' is not yes or no",
        "unknown backend",
        "'fp17' is not one of",
    ):
        assert complaint in result.stdout
    config, _ = load_config(target)
    assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 8)
    assert config.main_process_port == 29400 and config.dynamo_config["dynamo_backend"] == "EAGER"
    assert config.parallelism_config == {}


def test_questionnaire_for_a_parallel_layout_asks_until_the_sizes_fit(tmp_path):
    target = tmp_path / "nd.yaml"
    result = answer(
        target,
        [
            "",
            "multi-CPU",
            "1",  # machines
            "no",  # dynamo
            "no",  # DeepSpeed
            "yes",  # FSDP
            "NO_WRAP",
            "",  # reshard after forward
            "",  # offload
            "",  # state dict type
            "",  # activation checkpointing
            "8",  # processes per machine
            "yes",  # parallelism config
            "0",  # not a size
            "",  # dp_replicate_size [1]
            "",  # dp_shard_size [-1]
            "3",  # tp_size: 3 does not divide 8
            "",  # cp_size [1]
            "",  # pp_size [1]
            "2",  # dp_replicate_size, asked again
            "-2",  # not a size
            "-1",  # dp_shard_size: the rest
            "x",  # not a number
            "2",  # tp_size
            "-1",  # cp_size: a second -1
            "",  # pp_size [1]
            "2",  # dp_replicate_size, asked again
            "",  # dp_shard_size [-1]: 2
            "2",  # tp_size
            "1",  # cp_size
            "1",  # pp_size
            "3",  # ep_size: 3 does not divide the 2 sharding processes
            "1",  # ep_size: experts not split
            "yes",  # sequence parallelism
            "",  # mixed precision
        ],
    )
    assert result.returncode == 0, result.stderr
    for complaint in (
        "0 is not a size: give 1 or more, or -1",
        "-2 is not a size",
        "'x' is not a whole number",
        "does not divide the 8 processes",
        "only one parallel size may be -1",
        "3 does not divide the 2 processes that shard the model",
    ):
        assert complaint in result.stdout
    assert result.stdout.count("The sizes must multiply to 8") == 3
    config, _ = load_config(target)
    assert config.parallelism_config == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": -1,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
        "parallelism_config_pp_size": 1,
        "parallelism_config_sequence_parallel": True,
    }
    assert (config.distributed_type, config.num_processes) == ("FSDP", 8)
    valid = run_cli_here("config", "validate", str(target))
    assert valid.returncode == 0, valid.stderr
    assert "parallel layout dp_replicate=2 x dp_shard=2 x tp=2" in valid.stdout


def test_questionnaire_asks_the_context_parallel_exchange(tmp_path):
    target = tmp_path / "cp.yaml"
    lines = [
        *("", "multi-GPU", "1", "no", "no", "no", "2", "no", "y", "", "1", "", "2", ""),
        *("2", "alltoall", "bf16"),  # ep_size, the exchange, precision
    ]
    result = answer(target, lines)
    assert result.returncode == 0, result.stderr
    config, _ = load_config(target)
    assert config.parallelism_config["parallelism_config_cp_size"] == 2
    assert config.parallelism_config["parallelism_config_cp_comm_strategy"] == "alltoall"
    assert config.parallelism_config["parallelism_config_ep_size"] == 2
    assert config.parallel_layout() == "cp=2 (experts over ep=2)"


def test_questionnaire_for_deepspeed_writes_its_block(tmp_path):
    target = tmp_path / "ds.yaml"
    lines = [
        "",
        "multi-GPU",
        "1",
        "no",
        "yes",
        "no",
        "3",
        "cpu",
        "cpu",
        "4",
        "yes",
        "0.5",
        "yes",
        "no",
        "2",
        "bf16",
    ]
    result = answer(target, lines)
    assert result.returncode == 0, result.stderr
    assert "parallelism config" not in result.stdout, "DeepSpeed shards over every process"
    config, _ = load_config(target)
    assert config.distributed_type == "DEEPSPEED"
    assert config.deepspeed_config == {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": False,
    }


def test_input_ending_early_writes_nothing(tmp_path):
    target = tmp_path / "never.yaml"
    result = answer(target, ["", "multi-CPU"])
    assert result.returncode == 2 and "nothing was written" in result.stderr
    assert not target.exists()
    # The unanswered prompt's line is ended, so the error (on stderr) is not glued to it.
    assert result.stdout.endswith("How many machines will you use? [1]: \n"), result.stdout


def test_piped_answers_read_like_a_terminal_session(tmp_path):
    """Answers from a pipe are not echoed by a terminal: the questionnaire prints each after
    its prompt, so every question is on a line of its own."""
    target = tmp_path / "piped.yaml"
    answers = ["", "multi-CPU", "1", "no", "no", "no", "4", "no", "yes"]  # no Megatron-LM
    sizes = ["", "", "", "", "2", "2", "gpipe", ""]  # pp_size 2, ep_size 2, schedule, precision
    result = answer(target, answers + sizes)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "In which compute environment are you running? (0: LOCAL_MACHINE) [LOCAL_MACHINE]: ",
        "Which type of machine are you using? (0: no, 1: multi-CPU, 2: multi-GPU) [no]: multi-CPU",
        "How many machines will you use? [1]: 1",
    ]
    prompts = [line for line in lines if "?" in line]
    assert all(line.count("?") == 1 for line in prompts), "one question per line"
    assert all(line.count("(") == line.count(")") for line in lines), "balanced parentheses"
    assert "Do you want to compile your model with torch dynamo (torch.compile)? [yes/NO]: no" in (
        lines
    ), "a yes/no question shows its default once"
    layout = next(line for line in lines if "parallelism config" in line)
    assert all(word in layout for word in ("TP", "CP", "PP", "EP", "HSDP")), layout
    assert "How many pipeline stages (pp_size)? [1]: 2" in lines
    config, _ = load_config(target)
    assert config.parallelism_config["parallelism_config_pp_size"] == 2
    assert config.parallelism_config["parallelism_config_pp_schedule"] == "gpipe"
    assert config.parallel_layout() == "pp=2 x dp_shard=2 (experts over ep=2)"


def test_config_flags_that_name_an_action_point_to_it():
    result = run_cli_here("config", "--default")
    assert result.returncode == 2
    assert "unrecognized arguments: --default (did you mean 'slipstream config default'?)" in (
        result.stderr
    )


def test_config_default_and_validate(tmp_path):
    target = tmp_path / "default.yaml"
    result = run_cli_here(
        "config", "default", "--mixed_precision", "fp16", "--config_file", str(target)
    )
    assert result.returncode == 0 and target.exists(), result.stderr
    config, _ = load_config(target)
    assert config.mixed_precision == "fp16" and config.num_processes == 1
    again = run_cli_here("config", "default", "--config_file", str(target))
    assert again.returncode == 2 and "already exists" in again.stderr
    valid = run_cli_here("config", "validate", str(target))
    assert valid.returncode == 0 and "is a valid configuration" in valid.stdout
    assert write_basic_config(save_location=target) is False
    assert write_basic_config("bf16", tmp_path / "other.yaml") == tmp_path / "other.yaml"


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_real_accelerate_config_files_work_as_is(tmp_path, fixture):
    path = FIXTURES / fixture
    config, notes = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert config.distributed_type == str(raw["distributed_type"]).upper()
    assert config.num_processes == raw["num_processes"]
    assert config.mixed_precision == raw["mixed_precision"]
    if "ipex_config" in raw:
        assert any("ipex_config" in note and "does not support" in note for note in notes)
    assert config.parallelism_config == (raw.get("parallelism_config") or {})
    round_trip = save_config(config, tmp_path / "copy.yaml")
    assert load_config(round_trip)[0] == config
    result = run_cli_here("config", "validate", str(path))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "content,message",
    [
        ("num_processes: [2\n", "bad.yaml:2:1: not valid YAML"),
        ("num_procs: 2\n", "bad.yaml: unknown key 'num_procs' (did you mean 'num_processes'?)"),
        ("num_processes: two\n", "bad.yaml: key 'num_processes' must be an integer, got 'two'"),
        ("use_cpu: maybe\n", "bad.yaml: key 'use_cpu' must be true or false, got 'maybe'"),
        (
            "distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\ndeepspeed_config: {zero_stage: 2}\n",
            "bad.yaml: deepspeed_config and fsdp_config are both set",
        ),
        ("num_machines: 2\nnum_processes: 2\n", "bad.yaml: num_machines=2 needs main_process_ip"),
        ("deepspeed_config: {zero_stage: 5}\n", "zero_stage must be 0, 1, 2 or 3, got 5"),
        (
            "deepspeed_config: {zero_stag: 2}\n",
            "deepspeed_config: unknown key 'zero_stag' (did you mean 'zero_stage'?)",
        ),
        (
            "fsdp_config: {fsdp_auto_wrap_policy: NOPE}\n",
            "bad.yaml: fsdp_config: auto_wrap_policy must be one of",
        ),
        ("mixed_precision: fp12\n", "bad.yaml: mixed_precision must be one of"),
        (
            "num_processes: 2\nparallelism_config:\n  parallelism_config_tp_size: 4\n",
            "bad.yaml: parallelism_config: parallelism_config_tp_size=4 does not fit "
            "num_processes=2",
        ),
        (
            "num_processes: 2\nparallelism_config: {parallelism_config_tp_szie: 2}\n",
            "bad.yaml: parallelism_config: unknown key 'parallelism_config_tp_szie' (did you "
            "mean 'parallelism_config_tp_size'?)",
        ),
        (
            "num_processes: 2\ndistributed_type: DEEPSPEED\n"
            "parallelism_config: {parallelism_config_tp_size: 2}\n",
            "bad.yaml: parallelism_config: parallelism_config_tp_size=2 cannot be combined with "
            "DeepSpeed",
        ),
    ],
)
def test_bad_config_files_give_one_clear_message(tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    result = run_cli_here("config", "validate", str(bad))
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_env_shows_the_parallel_layout(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "num_processes: 4\nparallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_tp_size: 2\n"
    )
    result = run_cli_here("env", "--config_file", str(config))
    assert result.returncode == 0, result.stderr
    assert "parallelism_config_tp_size: 2" in result.stdout
    assert "- parallel layout: dp_shard=2 x tp=2" in result.stdout
    config.write_text("num_processes: 2\nparallelism_config: {parallelism_config_tp_size: 4}\n")
    result = run_cli_here("env", "--config_file", str(config))
    assert result.returncode == 0, "a bug report is written even for a broken config"
    assert "- config problem: " in result.stdout and "does not fit num_processes=2" in result.stdout
    config.write_text("num_processes: 4\nparallelism_config: {parallelism_config_ep_size: 2}\n")
    result = run_cli_here("env", "--config_file", str(config))
    assert "- parallel layout: dp_shard=4 (experts over ep=2)" in result.stdout
    assert (
        "- expert parallelism: experts split over ep=2 of the 4 processes that shard the model, "
        "each expert FSDP-sharded over 2"
    ) in result.stdout


def test_env_reports_versions_devices_and_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: bf16\n")
    result = run_cli("env", "--config_file", str(config))
    assert result.returncode == 0
    for expected in (
        "slipstream version",
        "PyTorch version",
        "GPU available",
        "Python version",
        "deepspeed version",
        "mixed_precision: bf16",
    ):
        assert expected in result.stdout


@pytest.mark.slow
def test_slipstream_test_runs_the_checks_under_a_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    result = run_cli("test", "--config_file", str(config), timeout=180)
    assert result.returncode == 0, result.stderr
    for check in ("process group", "sharded data", "collectives", "training"):
        assert f"PASS  {check}" in result.stdout
    assert "all checks passed" in result.stdout


def test_launch_help_groups_every_config_key():
    result = run_cli_here("launch", "--help")
    for title in (
        "processes and machines",
        "training",
        "FSDP",
        "DeepSpeed",
        "torch.compile",
        "fault tolerance",
    ):
        assert title in result.stdout
    for flag in (
        "--same_network",
        "--zero_stage",
        "--fsdp_state_dict_type",
        "--dynamo_mode",
        "--downcast_bf16",
        "--main_training_function",
        "--compute_environment",
    ):
        assert flag in result.stdout
