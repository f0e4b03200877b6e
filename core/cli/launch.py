"""``slipstream launch``: run a script on every process of a (multi-machine) job.

Configuration precedence: command-line flags > config file > defaults. Every config key is
also a flag, with an underscore and a dash spelling (``--num_processes`` /
``--num-processes``); ``--help`` groups them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..launcher import megatron_config as megatron
from ..launcher.config import (
    MIXED_PRECISION,
    ConfigError,
    LaunchConfig,
    config_from_dict,
    load_config,
    read_config_values,
)
from ..launcher.elastic import is_elastic, parse_nnodes
from ..launcher.xla import add_xla_options, check_xla_launch
from ..options.fault_tolerance import LAUNCH_FLAGS
from ..runtime.env import default_config_file

# (flag, type, help) per group; top-level flags map to config keys of the same name.
_TOP_LEVEL: dict[str, list[tuple[str, Any, str]]] = {
    "processes and machines": [
        ("num_processes", int, "total processes over all machines (default: GPUs, else 1)"),
        ("num_machines", int, "number of machines (default 1)"),
        ("machine_rank", int, "rank of this machine (0 hosts the job)"),
        ("main_process_ip", str, "address of machine 0 (multi-machine jobs)"),
        ("main_process_port", int, "port on machine 0 (default: free on one machine, else 29500)"),
        ("rdzv_backend", str, "torchrun rendezvous for several machines: c10d (default) or static"),
        ("rdzv_conf", str, "torchrun rendezvous options: key=value,... (e.g. last_call_timeout=5)"),
        ("min_machines", int, "elastic sizes: the fewest machines (num_machines is the most)"),
        (
            "elastic_batch",
            str,
            "elastic sizes keep the global batch (global: accumulation adjusts; default) or "
            "each process's batch (per_process)",
        ),
        ("same_network", str, "true when all machines share a network (informational)"),
        ("gpu_ids", str, "comma-separated GPU ids to use (default all)"),
        ("distributed_type", str, "NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED or XLA"),
        ("compute_environment", str, "LOCAL_MACHINE"),
        (
            "worker_start",
            str,
            "fork: workers forked from the launcher (torch imported once), exec: a fresh "
            "interpreter each (as torchrun), auto: fork for CPU jobs (default)",
        ),
    ],
    "training": [
        ("mixed_precision", str, f"one of {', '.join(MIXED_PRECISION)}"),
        ("gradient_accumulation_steps", int, "micro-batches per optimizer step"),
        ("downcast_bf16", str, "accepted for Accelerate config compatibility"),
        ("main_training_function", str, "accepted for Accelerate config compatibility"),
    ],
    "fault tolerance": [
        ("max_restarts", int, "restart the workers up to N times on failure"),
        ("monitor_interval", float, "seconds between worker health checks (default 0.1)"),
        (
            "preemption_signals",
            str,
            "signals that mean preempted, with --save_on_preemption (default SIGTERM,SIGUSR1)",
        ),
        (
            "termination_grace_period",
            float,
            "seconds stopping workers get before they are killed (default 30)",
        ),
        (
            "hang_timeout",
            float,
            "seconds without progress before a hang report ends the job (exit code 86; "
            "default: just under the collective timeout; 0: off)",
        ),
    ],
}
_SWITCHES = {  # store_const flags: flag -> (config key, value)
    "cpu": ("use_cpu", True),
    "debug": ("debug", True),
    "multi_gpu": ("distributed_type", "MULTI_GPU"),
    "use_fsdp": ("distributed_type", "FSDP"),
    "use_deepspeed": ("distributed_type", "DEEPSPEED"),
    "tpu": ("distributed_type", "XLA"),
    "use_megatron_lm": ("distributed_type", "MEGATRON_LM"),
    "save_on_preemption": ("save_on_preemption", True),
}
# Flags that fill a nested block of the config: block -> [(flag, key in block, type, help)].
_NESTED: dict[str, list[tuple[str, str, Any, str]]] = {
    "fsdp_config": [
        ("fsdp_version", "fsdp_version", int, "FSDP version (2)"),
        (
            "fsdp_auto_wrap_policy",
            "fsdp_auto_wrap_policy",
            str,
            "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP",
        ),
        (
            "fsdp_transformer_layer_cls_to_wrap",
            "fsdp_transformer_layer_cls_to_wrap",
            str,
            "comma-separated layer class names to shard",
        ),
        (
            "fsdp_min_num_params",
            "fsdp_min_num_params",
            int,
            "parameters of a module sharded on its own (size-based)",
        ),
        (
            "fsdp_reshard_after_forward",
            "fsdp_reshard_after_forward",
            str,
            "true: full shard; false: keep parameters until backward",
        ),
        (
            "fsdp_offload_params",
            "fsdp_offload_params",
            str,
            "true: keep parameters and optimizer state on the CPU",
        ),
        (
            "fsdp_state_dict_type",
            "fsdp_state_dict_type",
            str,
            "SHARDED_STATE_DICT or FULL_STATE_DICT for save_state",
        ),
        (
            "fsdp_activation_checkpointing",
            "fsdp_activation_checkpointing",
            str,
            "true: recompute the wrapped layers in backward",
        ),
    ],
    "deepspeed_config": [
        ("deepspeed_config_file", "deepspeed_config_file", str, "a DeepSpeed JSON config"),
        ("zero_stage", "zero_stage", int, "ZeRO stage 0-3"),
        ("offload_optimizer_device", "offload_optimizer_device", str, "none, cpu or nvme"),
        ("offload_param_device", "offload_param_device", str, "none, cpu or nvme"),
        ("offload_optimizer_nvme_path", "offload_optimizer_nvme_path", str, "NVMe folder"),
        ("offload_param_nvme_path", "offload_param_nvme_path", str, "NVMe folder"),
        ("gradient_clipping", "gradient_clipping", float, "gradient norm clipping value"),
        ("zero3_init_flag", "zero3_init_flag", str, "true: build models under zero.Init"),
        (
            "zero3_save_16bit_model",
            "zero3_save_16bit_model",
            str,
            "true: consolidate 16-bit weights when saving at ZeRO-3",
        ),
    ],
    "dynamo_config": [
        ("dynamo_backend", "dynamo_backend", str, "torch.compile backend (e.g. inductor)"),
        ("dynamo_mode", "dynamo_mode", str, "torch.compile mode"),
        ("dynamo_use_fullgraph", "dynamo_use_fullgraph", str, "true: compile one graph"),
        ("dynamo_use_dynamic", "dynamo_use_dynamic", str, "true: dynamic shapes"),
    ],
    # Accelerate's flag names are the block's keys; the sizes multiply to num_processes.
    "parallelism_config": [
        (f"parallelism_config_{key}", f"parallelism_config_{key}", kind, text)
        for key, kind, text in (
            ("dp_replicate_size", int, "data-parallel replicas (with dp_shard_size: HSDP)"),
            ("dp_shard_size", int, "processes that shard parameters (FSDP2); -1: the rest"),
            ("tp_size", int, "tensor-parallel processes (split each layer's weights)"),
            ("cp_size", int, "context-parallel processes (split each sequence; CUDA)"),
            ("pp_size", int, "pipeline stages"),
            (
                "ep_size",
                int,
                "expert-parallel processes: split the experts of MoE models (divides "
                "dp_shard x cp)",
            ),
            (
                "tp_plan",
                str,
                "tensor-parallel plan for a model without its own: comma-separated "
                "pattern=style, e.g. 'blocks.*.mlp.up=colwise,blocks.*.mlp.down=rowwise'",
            ),
            ("cp_comm_strategy", str, "context-parallel exchange: allgather or alltoall"),
            ("cp_backend", str, "context-parallel backend: torch"),
            ("sequence_parallel", str, "true: shard activations along the sequence between TP"),
            ("pp_schedule", str, "gpipe, 1f1b (default), interleaved_1f1b, looped_bfs, ..."),
            ("pp_microbatches", int, "micro-batches per batch (default: the stages)"),
            ("pp_stages_per_rank", int, "stages per process for interleaved schedules"),
            ("pp_split_points", str, "comma-separated module names where stages start"),
            ("pp_balance", str, "split blocks by parameters (default) or count"),
            (
                "ep_plan",
                str,
                "comma-separated module-name patterns of the experts modules (default: the "
                "model's own)",
            ),
        )
    ],
    # Per-step fault tolerance (torchft): replica groups drop out and rejoin per step.
    "fault_tolerance_config": list(LAUNCH_FLAGS),
    "megatron_lm_config": list(megatron.LAUNCH_FLAGS),  # Accelerate's names, key by key
}
_GROUP_TITLES = {
    "fsdp_config": "FSDP (fully sharded data parallel, FSDP2)",
    "deepspeed_config": "DeepSpeed",
    "dynamo_config": "torch.compile",
    "parallelism_config": "N-D parallelism (ParallelismConfig: sizes multiply to num_processes)",
    "fault_tolerance_config": "per-step fault tolerance (torchft replica groups)",
    "megatron_lm_config": "Megatron-LM (tensor/pipeline parallelism with FSDP2; docs/megatron.md)",
}


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
        # The generated usage lists all ~60 flags; they are listed by group below it.
        usage="%(prog)s [-h] [options] training_script [script arguments ...]",
        # A script's own flag (--save) must never be read as an abbreviation of ours
        # (--save_on_preemption): everything after the script belongs to the script.
        allow_abbrev=False,
    )
    parser.set_defaults(run=run)
    _option(parser, "config_file", help="YAML config (default: the one `slipstream config` wrote)")
    for title, flags in _TOP_LEVEL.items():
        group = parser.add_argument_group(title)
        for flag, kind, text in flags:
            _option(group, flag, *(["-n"] if flag == "num_processes" else []), type=kind, help=text)
        if title == "processes and machines":
            _option(
                group, "cpu", action="store_const", const=True, help="use the CPU even with GPUs"
            )
            _option(
                group,
                "nnodes",
                metavar="MIN:MAX",
                help="torchrun's spelling: machines (2), or a range (1:3) for elastic sizes",
            )
            _option(
                group, "nproc_per_node", type=int, help="processes per machine (torchrun's flag)"
            )
            _option(
                group,
                "rdzv_endpoint",
                metavar="HOST:PORT",
                help="torchrun's spelling of main_process_ip:main_process_port",
            )
            _option(
                group,
                "multi_gpu",
                action="store_const",
                const=True,
                help="data-parallel training on several GPUs",
            )
            add_xla_options(group, _option)  # --tpu, --tpu_cluster
        if title == "training":
            _option(
                group,
                "debug",
                action="store_const",
                const=True,
                help="check every collective for matching calls on all ranks",
            )
            _option(
                group,
                "verbose",
                action="store_const",
                const=True,
                help="show torch's elastic agent's own log lines (hidden otherwise)",
            )
        if title == "fault tolerance":
            _option(
                group,
                "save_on_preemption",
                action="store_const",
                const=True,
                help="on a preemption signal save a checkpoint at the next step, exit for requeue",
            )
    for block, nested in _NESTED.items():
        group = parser.add_argument_group(_GROUP_TITLES[block])
        if block == "fsdp_config":
            _option(
                group, "use_fsdp", action="store_const", const=True, help="shard models with FSDP2"
            )
        if block == "deepspeed_config":
            _option(
                group,
                "use_deepspeed",
                action="store_const",
                const=True,
                help="train with DeepSpeed ZeRO",
            )
        if block == "parallelism_config":
            # Accelerate needs this switch before it reads the sizes; here any size flag (or
            # the file's block) is enough, so the switch is accepted and changes nothing.
            _option(
                group,
                "use_parallelism_config",
                action="store_const",
                const=True,
                help="accepted for Accelerate compatibility (the sizes below are used anyway)",
            )
        if block == "fault_tolerance_config":
            _option(
                group,
                "fault_tolerance",
                action="store_const",
                const=True,
                help="replica groups drop out and rejoin per step (torchft; see the ft_ flags)",
            )
        if block == "megatron_lm_config":
            _option(group, "use_megatron_lm", **megatron.SWITCH)
        # The parallelism flags' own names are long enough without a metavar repeating them.
        short = block in ("parallelism_config", "megatron_lm_config")
        for flag, _, kind, text in nested:
            shown = {"metavar": "N" if kind is int else "VALUE"} if short else {}
            _option(group, flag, type=kind, help=text, **shown)
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
    # Optional here so that a bare `slipstream launch` gets a sentence, not argparse's list of
    # "required" positionals (the script's arguments never are).
    parser.add_argument("training_script", nargs="?", help="the script (or module) to run")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )


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
    file_error: ConfigError | None = None
    if path is not None:
        values = read_config_values(path)
        try:
            _, notes = load_config(path)  # reports problems with the file's own name
        except ConfigError as error:
            # A flag may fix what the file gets wrong (a parallel layout for another
            # num_processes, say); the file's own message is kept for when none does.
            file_error = error
    for flags in _TOP_LEVEL.values():
        for flag, _, _ in flags:
            if getattr(args, flag) is not None:
                values[flag] = getattr(args, flag)
    for flag, (key, value) in _SWITCHES.items():
        if getattr(args, flag):
            values[key] = value
    values.update(torchrun_style_values(args, values))
    for block, nested in _NESTED.items():
        given = {k: getattr(args, f) for f, k, _, _ in nested if getattr(args, f) is not None}
        if given:
            values[block] = {**(values.get(block) or {}), **given}
    if getattr(args, "fault_tolerance", None) and not values.get("fault_tolerance_config"):
        values["fault_tolerance_config"] = {"min_replicas": 1}
    if values.get("fsdp_config") and values.get("distributed_type", "NO") in (
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
    ):
        values["distributed_type"] = "FSDP"
    if values.get("deepspeed_config") and values.get("distributed_type", "NO") in (
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
    ):
        values["distributed_type"] = "DEEPSPEED"
    check_xla_launch(values, bool(getattr(args, "tpu_cluster", None)))
    if "num_processes" not in values:
        machines = int(values.get("num_machines", 1) or 1)
        values["num_processes"] = machines * _default_processes(bool(values.get("use_cpu")))
    if values.get("distributed_type", "NO") == "NO" and int(values["num_processes"]) > 1:
        import torch

        gpu = torch.cuda.is_available() and not values.get("use_cpu")
        values["distributed_type"] = "MULTI_GPU" if gpu else "MULTI_CPU"
    try:
        config, more = config_from_dict(values, where="options")
    except ConfigError:
        if file_error is not None:
            raise file_error from None
        raise
    _check_strategy_available(config)
    _check_gpus(config)
    more += megatron.megatron_notes(config)
    if is_elastic(config) and config.max_restarts == 0:
        more.append(
            f"--nnodes {config.min_machines}:{config.num_machines} with max_restarts=0: a lost "
            "machine stops the job (each loss uses one restart); set --max_restarts"
        )
    return config, notes + more


def torchrun_style_values(args: argparse.Namespace, values: dict[str, Any]) -> dict[str, Any]:
    """Config keys from torchrun's flags: ``--nnodes [MIN:]MAX`` (min_machines,
    num_machines), ``--nproc_per_node`` (num_processes = per machine x machines) and
    ``--rdzv_endpoint HOST:PORT`` (main_process_ip, main_process_port)."""
    found: dict[str, Any] = {}
    if getattr(args, "nnodes", None) is not None:
        low, high = parse_nnodes(args.nnodes)
        found.update(num_machines=high, min_machines=low if low < high else None)
    if getattr(args, "nproc_per_node", None) is not None:
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
        machines = int(found.get("num_machines", values.get("num_machines", 1)) or 1)
        found["num_processes"] = args.nproc_per_node * machines
    endpoint = getattr(args, "rdzv_endpoint", None)
    if endpoint is not None:
        host, _, port = str(endpoint).rpartition(":")
        if not host or not port.isdecimal():
            raise ConfigError(f"--rdzv_endpoint {endpoint}: give HOST:PORT, e.g. 10.0.0.1:29400")
        found.update(main_process_ip=host, main_process_port=int(port))
    return found


def _check_gpus(config: LaunchConfig) -> None:
    """More processes per machine than GPUs cannot work on GPUs (one GPU per process)."""
    if config.use_cpu or config.distributed_type == "XLA":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.gpu_ids not in ("all", ""):
        gpus = min(gpus, len([g for g in config.gpu_ids.split(",") if g.strip()]))
    per_machine = config.num_processes // config.num_machines
    if gpus and per_machine > gpus:
        raise ConfigError(
            f"num_processes={config.num_processes} puts {per_machine} processes on each "
            f"machine, but this one has {gpus} GPU(s) and each process needs its own: use "
            f"--num_processes {gpus * config.num_machines}, or --cpu to train on the CPU"
        )


def _check_strategy_available(config: LaunchConfig) -> None:
    from ..strategies import available_strategies

    needed = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(config.distributed_type)
    if needed is not None and needed not in available_strategies():
        raise ConfigError(
            f"distributed_type: {config.distributed_type} is not supported by this version of "
            f"slipstream yet (available strategies: {', '.join(available_strategies())})"
        )


def run(args: argparse.Namespace) -> int:
    from ..launcher.launch import LaunchRequest, launch

    if args.training_script is None:
        raise ConfigError(
            "name the script to run after the flags, e.g. `slipstream launch "
            "--num_processes 2 train.py --lr 1e-3` (or `-m package.module`); "
            "`slipstream launch --help` lists the flags"
        )
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
