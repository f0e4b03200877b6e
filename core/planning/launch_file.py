"""A planned layout as a ``slipstream launch`` config file: the same keys ``slipstream
config`` writes (``distributed_type``, ``num_processes``, ``num_machines``,
``mixed_precision``, ``gradient_accumulation_steps``, a ``parallelism_config`` block, an
``fsdp_config`` block when recomputation or offload is on, and for ZeRO a DeepSpeed JSON
file beside it, named by ``deepspeed_config_file``). The launcher's own loader checks the
result before it is written.

Example::

    path = write_launch_config(plan[0], plan.cluster, "config.yaml")
    # slipstream launch --config_file config.yaml train.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..launcher.config import config_from_dict, save_config
from .hardware import Cluster

if TYPE_CHECKING:
    from .candidates import Candidate


def launch_values(
    candidate: Candidate, cluster: Cluster, deepspeed_file: str | None = None
) -> dict[str, Any]:
    """The config file's keys for ``candidate`` on ``cluster``."""
    layout = candidate.layout
    cpu = cluster.device.name == "CPU"
    values: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_processes": cluster.world_size,
        "num_machines": cluster.nodes,
        "mixed_precision": layout.mixed_precision,
        "use_cpu": cpu,
        "gradient_accumulation_steps": layout.accumulation,
    }
    if layout.engine == "ddp":
        values["distributed_type"] = "MULTI_CPU" if cpu else "MULTI_GPU"
        if cluster.device.engines == "ddp":
            values["distributed_type"] = "XLA"
    elif layout.engine.startswith("zero"):
        values["distributed_type"] = "DEEPSPEED"
        values["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file}
    else:
        from ..parallel.config import ParallelismConfig

        values["distributed_type"] = "FSDP"
        values["parallelism_config"] = ParallelismConfig(**layout.parallelism).to_config()
        options = layout.fsdp_options(candidate.wrap_classes)
        if options:
            fsdp: dict[str, Any] = {
                "fsdp_version": 2,
                "fsdp_activation_checkpointing": options["activation_checkpointing"],
                "fsdp_offload_params": options["cpu_offload"],
                "fsdp_state_dict_type": options["state_dict_type"],
            }
            if "transformer_cls_names_to_wrap" in options:
                fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
                fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(
                    options["transformer_cls_names_to_wrap"]
                )
            values["fsdp_config"] = fsdp
    return values


def write_launch_config(candidate: Candidate, cluster: Cluster, path: str | Path) -> Path:
    """Write ``candidate`` as a launch config at ``path`` (checked by the launcher's loader
    first); ZeRO layouts also get ``<path stem>.deepspeed.json``."""
    path = Path(path)
    deepspeed_file = None
    if candidate.layout.engine.startswith("zero"):
        ds_path = path.with_name(path.stem + ".deepspeed.json")
        settings = candidate.layout.deepspeed_config(candidate.buckets or None)
        if candidate.layout.mixed_precision in ("bf16", "fp16"):
            settings[candidate.layout.mixed_precision] = {"enabled": True}
        ds_path.parent.mkdir(parents=True, exist_ok=True)
        ds_path.write_text(json.dumps(settings, indent=2) + "\n")
        deepspeed_file = str(ds_path)
    config, _ = config_from_dict(launch_values(candidate, cluster, deepspeed_file), where=str(path))
    return save_config(config, path)
