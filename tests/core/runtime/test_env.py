"""Reading the launcher environment (pure: explicit dictionaries, no processes), and
Accelerate's environment helpers."""

from __future__ import annotations

import json
import os

import pytest

from slipstream.runtime.env import (
    LAUNCH_CONFIG_VARIABLE,
    LaunchEnvironmentError,
    clear_environment,
    default_config_file,
    first_slurm_host,
    get_int_from_env,
    log_level_from_environment,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    purge_accelerate_environment,
    read_launch_environment,
    str_to_bool,
)


def test_single_process_without_launcher_variables():
    env = read_launch_environment({})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single")


def test_torchrun_variables():
    env = read_launch_environment(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.1", 1234, "torchrun")
    assert not env.needs_init_method


def test_slurm_step_with_several_tasks():
    env = read_launch_environment(
        {
            "SLURM_PROCID": "5",
            "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu07" and env.master_port == 15000 + 4242
    assert env.source == "slurm" and env.needs_init_method


def test_plain_python_inside_a_slurm_allocation_stays_single():
    env = read_launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert env.world_size == 1 and env.source == "single"


def test_mpi_needs_a_master_address():
    with pytest.raises(LaunchEnvironmentError, match="MASTER_ADDR"):
        read_launch_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    env = read_launch_environment(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "9",
        }
    )
    assert (env.rank, env.world_size, env.source) == (1, 2, "mpi")


@pytest.mark.parametrize(
    "variables,message",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 with world size 2"),
        ({LAUNCH_CONFIG_VARIABLE: "{nope"}, "not valid JSON"),
        ({LAUNCH_CONFIG_VARIABLE: "[1]"}, "JSON object"),
    ],
)
def test_bad_variables_say_what_is_wrong(variables, message):
    with pytest.raises(LaunchEnvironmentError, match=message.replace("(", r"\(")):
        read_launch_environment(variables)


def test_launch_config_and_debug_flag():
    env = read_launch_environment(
        {LAUNCH_CONFIG_VARIABLE: json.dumps({"mixed_precision": "bf16"}), "SLIPSTREAM_DEBUG": "1"}
    )
    assert env.launch_config == {"mixed_precision": "bf16"} and env.debug


@pytest.mark.parametrize(
    "nodelist,first",
    [("node1", "node1"), ("n[3-5,9]", "n3"), ("a[01-02],b7", "a01"), ("x[7]", "x7")],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_default_config_file_location(tmp_path):
    assert default_config_file({"XDG_CACHE_HOME": str(tmp_path)}) == (
        tmp_path / "slipstream" / "default_config.yaml"
    )
    override = tmp_path / "c.yaml"
    assert default_config_file({"SLIPSTREAM_CONFIG_FILE": str(override)}) == override


# -- Accelerate's environment helpers ----------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [("Yes", 1), ("y", 1), ("TRUE", 1), ("on", 1), ("1", 1), ("no", 0), ("F", 0), ("off", 0)],
)
def test_str_to_bool_reads_yes_and_no(value, expected):
    assert str_to_bool(value) == expected and type(str_to_bool(value)) is int
    assert str_to_bool(value, to_bool=True) is bool(expected)


@pytest.mark.parametrize("value", ["", "maybe", "2", "yess"])
def test_str_to_bool_refuses_anything_else(value):
    with pytest.raises(ValueError, match=f"invalid truth value {value!r}; use one of y, yes"):
        str_to_bool(value)


def test_flags_choices_and_integers_from_the_environment():
    with patch_environment(slipstream_test_a="-1", slipstream_test_b="7", slipstream_test_c="no"):
        assert get_int_from_env(["SLIPSTREAM_TEST_A", "SLIPSTREAM_TEST_B"], 3) == 7
        assert get_int_from_env(["SLIPSTREAM_TEST_A", "SLIPSTREAM_TEST_MISSING"], 3) == 3
        assert parse_flag_from_env("SLIPSTREAM_TEST_C", default=True) is False
        assert parse_flag_from_env("SLIPSTREAM_TEST_MISSING", default=True) is True
        assert parse_flag_from_env("SLIPSTREAM_TEST_MISSING") is False
        assert parse_choice_from_env("SLIPSTREAM_TEST_C") == "no"
        assert parse_choice_from_env("SLIPSTREAM_TEST_MISSING", "bf16") == "bf16"
    with patch_environment(slipstream_test_a="x"), pytest.raises(ValueError):
        get_int_from_env(["SLIPSTREAM_TEST_A"], 0)


def test_patch_environment_restores_and_removes(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TEST_KEPT", "before")
    monkeypatch.delenv("SLIPSTREAM_TEST_NEW", raising=False)
    with (
        pytest.raises(RuntimeError),
        patch_environment(slipstream_test_kept=1, SLIPSTREAM_TEST_NEW=2.5),
    ):
        assert os.environ["SLIPSTREAM_TEST_KEPT"] == "1"
        assert os.environ["SLIPSTREAM_TEST_NEW"] == "2.5"
        raise RuntimeError("the block fails; the variables are restored anyway")
    assert os.environ["SLIPSTREAM_TEST_KEPT"] == "before"
    assert "SLIPSTREAM_TEST_NEW" not in os.environ


def test_clear_environment_empties_then_restores(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TEST_KEPT", "before")
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["SLIPSTREAM_TEST_INSIDE"] = "1"
    assert dict(os.environ) == before


def test_purge_accelerate_environment_on_functions_and_test_classes(monkeypatch):
    monkeypatch.setenv("ACCELERATE_KEPT", "before")

    @purge_accelerate_environment
    def sets_variables():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["SLIPSTREAM_TEST_SET"] = "1"
        os.environ["ACCELERATE_KEPT"] = "changed"
        os.environ["OTHER_TEST_VARIABLE"] = "stays"
        return "result"

    assert sets_variables() == "result"
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ
    assert "SLIPSTREAM_TEST_SET" not in os.environ
    assert os.environ["ACCELERATE_KEPT"] == "before"
    assert os.environ.pop("OTHER_TEST_VARIABLE") == "stays"

    @purge_accelerate_environment
    class Base:
        def test_one(self):
            os.environ["ACCELERATE_FROM_BASE"] = "1"

        def helper(self):
            os.environ["ACCELERATE_FROM_HELPER"] = "1"

    class Child(Base):
        def test_two(self):
            os.environ["ACCELERATE_FROM_CHILD"] = "1"

    Child().test_one()
    Child().test_two()
    Child().helper()
    assert "ACCELERATE_FROM_BASE" not in os.environ
    assert "ACCELERATE_FROM_CHILD" not in os.environ, "subclasses are purged too"
    assert os.environ.pop("ACCELERATE_FROM_HELPER") == "1", "only test* methods are wrapped"


def test_log_level_from_environment(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    assert log_level_from_environment() is None
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    assert log_level_from_environment() == "debug"
    monkeypatch.setenv("SLIPSTREAM_LOG_LEVEL", "WARNING")
    assert log_level_from_environment() == "WARNING"
