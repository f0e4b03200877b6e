"""Reading the launcher environment (pure: explicit dictionaries, no processes)."""

from __future__ import annotations

import json

import pytest

from slipstream.env import (
    LAUNCH_CONFIG_VARIABLE,
    LaunchEnvironmentError,
    default_config_file,
    first_slurm_host,
    read_launch_environment,
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
