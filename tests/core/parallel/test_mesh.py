"""The job's DeviceMesh and the coordinates the Accelerator reports, on 2 CPU processes."""

from __future__ import annotations

from typing import Any

import torch

from slipstream import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from tests.distributed import run_distributed


def _coordinates(kind: str) -> dict[str, Any]:
    if kind == "ddp":
        acc = Accelerator()
    elif kind == "fsdp":
        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    else:
        acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2))
    mesh = acc.torch_device_mesh
    return {
        "type": acc.distributed_type.value,
        "replicate": acc.data_parallel_rank,
        "shard": acc.data_parallel_shard_rank,
        "others": (acc.tensor_parallel_rank, acc.context_parallel_rank, acc.pipeline_parallel_rank),
        "mesh": None if mesh is None else (tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
        "data_parallel": (acc.state.data_parallel_index, acc.state.data_parallel_size),
        "gathered": acc.gather(torch.tensor([acc.process_index])).tolist(),
    }


def _all_layouts() -> list[dict[str, Any]]:
    return [_coordinates(kind) for kind in ("ddp", "fsdp", "replicas")]


def test_coordinates_with_and_without_a_parallel_layout():
    first, second = run_distributed(_all_layouts, world_size=2, timeout=180)
    ddp, fsdp, replicas = zip(first, second, strict=True)
    # DDP: every process is a replica; FSDP: every process a shard. No mesh is built.
    assert [c["replicate"] for c in ddp] == [0, 1] and [c["shard"] for c in ddp] == [0, 0]
    assert [c["shard"] for c in fsdp] == [0, 1] and [c["replicate"] for c in fsdp] == [0, 0]
    assert all(c["mesh"] is None and c["others"] == (0, 0, 0) for c in ddp + fsdp)
    # A layout of replicas only: the mesh keeps both data-parallel dimensions.
    assert [c["mesh"] for c in replicas] == [(("dp_replicate", "dp_shard"), (2, 1))] * 2
    assert [c["replicate"] for c in replicas] == [0, 1]
    assert [c["data_parallel"] for c in replicas] == [(0, 2), (1, 2)]
    assert all(c["gathered"] == [0, 1] for c in ddp + fsdp + replicas)
