"""Accelerate's view of ParallelismConfig: the layout ``accelerate launch`` hands over in
``PARALLELISM_CONFIG_*`` variables, the dimension names and ``build_device_mesh``."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream import Accelerator, ParallelismConfig
from slipstream.parallel import ParallelismConfigError, TorchContextParallelConfig
from tests.distributed import run_distributed

#: What `accelerate launch --parallelism_config_dp_shard_size 2` sets for its workers.
ACCELERATE_LAUNCH = {
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    "PARALLELISM_CONFIG_TP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_BACKEND": "torch",
    "PARALLELISM_CONFIG_SP_SIZE": "1",
    "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
}


def test_sizes_not_given_come_from_accelerates_launcher_variables(monkeypatch):
    for key, value in ACCELERATE_LAUNCH.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    config = ParallelismConfig(tp_size=2)  # given: the argument wins
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 2, 2)
    assert ParallelismConfig().tp_size == 4
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
    assert TorchContextParallelConfig("allgather").cp_comm_strategy == "allgather"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "ring")
    with pytest.raises(
        ParallelismConfigError,
        match=r"Invalid cp_comm_strategy: ring \(from PAR",
    ):
        ParallelismConfig(cp_size=2)
    monkeypatch.delenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ParallelismConfigError, match="PARALLELISM_CONFIG_TP_SIZE must be an int"):
        ParallelismConfig()
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ParallelismConfigError, match="SP_SIZE=2 asks for DeepSpeed sequence"):
        ParallelismConfig()


def test_without_launcher_variables_sizes_stay_unset():
    config = ParallelismConfig(tp_size=2)
    assert config.dp_shard_size is None and config.dp_replicate_size is None


def test_dimension_names_follow_the_sizes():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert config.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert config.non_dp_dim_names == ["tp", "cp"]
    assert config.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert config.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert ParallelismConfig(tp_size=1).build_device_mesh("cpu") is None


def _layouts() -> dict[str, Any]:
    accelerator = Accelerator()  # started "by accelerate launch": its variables say dp_shard 2
    config = accelerator.parallelism_config
    job_mesh = accelerator.torch_device_mesh
    own = ParallelismConfig(dp_shard_size=2).build_device_mesh("cpu")
    assert own is not None
    return {
        "sizes": (config.dp_replicate_size, config.dp_shard_size, config.tp_size),
        "job mesh": dict(zip(job_mesh.mesh_dim_names, job_mesh.shape, strict=True)),
        "shard rank": accelerator.data_parallel_shard_rank,
        "own mesh": (own.mesh_dim_names, own.shape),
        "flattened": [own[name].size() for name in ("dp", "dp_shard_cp", "dp_cp")],
        "flattened rank": own["dp"].get_local_rank(),
    }


def test_a_script_started_by_accelerate_launch_sees_its_layout():
    first, second = run_distributed(_layouts, world_size=2, env=ACCELERATE_LAUNCH, timeout=180)
    assert first["sizes"] == second["sizes"] == (1, 2, 1)
    assert first["job mesh"]["dp_shard"] == 2
    assert [first["shard rank"], second["shard rank"]] == [0, 1]
    assert first["own mesh"] == (("dp_shard",), (2,))
    assert first["flattened"] == second["flattened"] == [2, 2, 2]
    assert [first["flattened rank"], second["flattened rank"]] == [0, 1]
