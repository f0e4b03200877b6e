"""``slipstream launch``: run a script on every process of a (multi-machine) job.

Configuration precedence: command-line flags > config file > defaults. Every option has an
underscore and a dash spelling (``--num_processes`` / ``--num-processes``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..config import (
    MIXED_PRECISION,
    ConfigError,
    LaunchConfig,
    config_from_dict,
    load_config,
    read_config_values,
)
from ..env import default_config_file


def _option(group: Any, name: str, *extra: str, **kwargs: Any) -> None:
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    group.add_argument(*extra, *spellings, dest=name, **kwargs)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on several processes / machines",
        description="Run a training script on every process of a job (built on torchrun).",
    )
    parser.set_defaults(run=run)
    parser.add_argument(
        "--config_file",
        "--config-file",
        dest="config_file",
        default=None,
        help="YAML config (default: the file written by `slipstream config`)",
    )

    hardware = parser.add_argument_group("processes and machines")
    _option(
        hardware,
        "num_processes",
        "-n",
        type=int,
        help="total processes over all machines (default: GPUs, else 1)",
    )
    _option(hardware, "num_machines", type=int, help="number of machines (default 1)")
    _option(hardware, "machine_rank", type=int, help="rank of this machine (0 hosts the job)")
    _option(hardware, "main_process_ip", help="address of machine 0 (multi-machine jobs)")
    _option(
        hardware,
        "main_process_port",
        type=int,
        help="port on machine 0 (default: a free port on one machine, 29500 on several)",
    )
    _option(
        hardware,
        "rdzv_backend",
        choices=["c10d", "static"],
        help="torchrun rendezvous for multi-machine jobs (default c10d)",
    )
    _option(hardware, "cpu", action="store_const", const=True, help="use the CPU even with GPUs")
    _option(
        hardware,
        "multi_gpu",
        action="store_const",
        const=True,
        help="data-parallel training on several GPUs",
    )
    _option(hardware, "gpu_ids", help="comma-separated GPU ids to use (default all)")

    training = parser.add_argument_group("training")
    _option(training, "mixed_precision", choices=list(MIXED_PRECISION), help="mixed precision mode")
    _option(
        training,
        "dynamo_backend",
        help="torch.compile prepared models with this backend (e.g. inductor)",
    )
    _option(
        training, "gradient_accumulation_steps", type=int, help="micro-batches per optimizer step"
    )
    _option(
        training,
        "debug",
        action="store_const",
        const=True,
        help="check every collective for matching calls on all ranks",
    )

    fsdp = parser.add_argument_group("FSDP (fully sharded data parallel, FSDP2)")
    _option(fsdp, "use_fsdp", action="store_const", const=True, help="shard models with FSDP2")
    for key, kind, text in _FSDP_FLAGS:
        _option(fsdp, key, type=kind, help=text)

    fault = parser.add_argument_group("fault tolerance")
    _option(fault, "max_restarts", type=int, help="restart the workers up to N times on failure")
    _option(fault, "monitor_interval", type=float, help="seconds between worker health checks")

    target = parser.add_argument_group("what to run")
    _option(
        target,
        "module",
        "-m",
        action="store_true",
        help="run the target as a module, like python -m",
    )
    _option(
        target,
        "no_python",
        action="store_true",
        help="run the target as an executable, not with python",
    )
    parser.add_argument("training_script", help="the script (or module) to run")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )


_FSDP_FLAGS: list[tuple[str, Any, str]] = [
    ("fsdp_version", int, "FSDP version (2)"),
    ("fsdp_auto_wrap_policy", str, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP"),
    ("fsdp_transformer_layer_cls_to_wrap", str, "comma-separated layer class names to shard"),
    ("fsdp_min_num_params", int, "parameters of a module sharded on its own (size-based)"),
    ("fsdp_reshard_after_forward", str, "true: full shard; false: keep params until backward"),
    ("fsdp_offload_params", str, "true: keep parameters and optimizer state on the CPU"),
    ("fsdp_state_dict_type", str, "SHARDED_STATE_DICT or FULL_STATE_DICT for save_state"),
    ("fsdp_activation_checkpointing", str, "true: recompute the wrapped layers in backward"),
]

_FLAG_TO_KEY = {
    "num_processes": "num_processes",
    "num_machines": "num_machines",
    "machine_rank": "machine_rank",
    "main_process_ip": "main_process_ip",
    "main_process_port": "main_process_port",
    "rdzv_backend": "rdzv_backend",
    "cpu": "use_cpu",
    "gpu_ids": "gpu_ids",
    "mixed_precision": "mixed_precision",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "debug": "debug",
    "max_restarts": "max_restarts",
    "monitor_interval": "monitor_interval",
}


def _default_processes(use_cpu: bool) -> int:
    import torch

    if not use_cpu and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def resolve_config(args: argparse.Namespace) -> tuple[LaunchConfig, list[str]]:
    """Merge flags over the config file over defaults."""
    path = args.config_file
    if path is None and default_config_file().is_file():
        path = default_config_file()
    values: dict[str, Any] = {}
    notes: list[str] = []
    if path is not None:
        _, notes = load_config(path)  # reports problems with the file's own name
        values = read_config_values(path)
    flags = {key: getattr(args, flag) for flag, key in _FLAG_TO_KEY.items()}
    values.update({key: value for key, value in flags.items() if value is not None})
    if "num_processes" not in values:
        machines = int(values.get("num_machines", 1) or 1)
        values["num_processes"] = machines * _default_processes(bool(values.get("use_cpu")))
    if args.multi_gpu:
        values["distributed_type"] = "MULTI_GPU"
    elif values.get("distributed_type", "NO") == "NO" and int(values["num_processes"]) > 1:
        import torch

        gpu = torch.cuda.is_available() and not values.get("use_cpu")
        values["distributed_type"] = "MULTI_GPU" if gpu else "MULTI_CPU"
    fsdp = {key: getattr(args, key) for key, _, _ in _FSDP_FLAGS if getattr(args, key) is not None}
    if args.use_fsdp or fsdp:
        values["distributed_type"] = "FSDP"
        values["fsdp_config"] = {**(values.get("fsdp_config") or {}), **fsdp}
    if args.dynamo_backend is not None:
        values["dynamo_config"] = {
            **(values.get("dynamo_config") or {}),
            "dynamo_backend": args.dynamo_backend.upper(),
        }
    config, more = config_from_dict(values, where="options")
    _check_strategy_available(config)
    return config, notes + more


def _check_strategy_available(config: LaunchConfig) -> None:
    from ..strategies import available_strategies

    needed = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(config.distributed_type)
    if needed == "fsdp":
        from ..strategies import FullyShardedDataParallelPlugin

        try:
            FullyShardedDataParallelPlugin.from_config(config.fsdp_config)
        except ValueError as error:
            raise ConfigError(
                str(error) if "fsdp_config" in str(error) else f"fsdp_config: {error}"
            ) from None
    if needed is not None and needed not in available_strategies():
        raise ConfigError(
            f"distributed_type: {config.distributed_type} is not supported by this version of "
            f"slipstream yet (available strategies: {', '.join(available_strategies())})"
        )


def run(args: argparse.Namespace) -> int:
    from ..launch import LaunchRequest, launch

    config, notes = resolve_config(args)
    for note in notes:
        print(f"slipstream launch: note: {note}")
    script = args.training_script
    if not args.module and not args.no_python and not os.path.isfile(script):
        raise ConfigError(
            f"training script {script!r} does not exist; give the path of a Python file "
            "(or use -m for a module)"
        )
    request = LaunchRequest(
        config=config,
        script=script,
        script_args=list(args.training_script_args),
        module=args.module,
        no_python=args.no_python,
    )
    return launch(request)
