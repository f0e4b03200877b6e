"""The values of a ``parallelism_config`` block, checked: sizes, switches, pipeline schedule
names and expert plans, each turned into what :class:`ParallelismConfig` holds or refused
with a message naming the key.

Example::

    schedule_name("Schedule1F1B")        # "1f1b"
    as_size("parallelism_config_tp_size", "2")   # 2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ParallelismConfigError

#: Pipeline schedules (torch.distributed.pipelining's), by slipstream's names.
PIPELINE_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
PIPELINE_BALANCE = ("parameters", "count")
#: The keys of a ``parallelism_config`` block (after the ``parallelism_config_`` prefix).
CONFIG_KEYS = (
    "dp_replicate_size",
    "dp_shard_size",
    "tp_size",
    "cp_size",
    "pp_size",
    "ep_size",
    "ep_plan",
    "cp_backend",
    "cp_comm_strategy",
    "tp_plan",
    "sequence_parallel",
    "sequence_dim",
    "pp_schedule",
    "pp_microbatches",
    "pp_stages_per_rank",
    "pp_split_points",
    "pp_balance",
)
# Accelerate's DeepSpeed-Ulysses keys: accepted only when they ask for nothing.
UNSUPPORTED_ACCELERATE_KEYS: dict[str, tuple[Any, ...]] = {
    "sp_size": (1, "1", None),
    "sp_backend": ("deepspeed", None),
    "sp_seq_length": (None,),
    "sp_seq_length_is_variable": (True, "true", None),
    "sp_attn_implementation": (None,),
}


def schedule_name(name: str) -> str:
    """slipstream's name for a pipeline schedule (torch's class names are accepted too)."""
    lowered = str(name).strip().lower().replace("-", "_")
    for ours, theirs in PIPELINE_SCHEDULES.items():
        if lowered in (ours, theirs.lower(), theirs.lower().removeprefix("schedule")):
            return ours
    raise ParallelismConfigError(
        f"unknown pipeline schedule {name!r}; use one of {', '.join(PIPELINE_SCHEDULES)}"
    )


def plain_tp_plan(value: Any, key: str = "tp_plan") -> dict[str, str]:
    """A tp_plan as config files and ``--parallelism_config_tp_plan`` write it: a mapping of
    module-name patterns to styles, or the text ``"pattern=style,pattern=style"``.

    Example::

        plain_tp_plan("mlp.up=colwise,mlp.down=rowwise")   # {"mlp.up": "colwise", ...}
    """
    if isinstance(value, str):
        # The flag's spelling; a pattern never holds ',' or '=' (module names cannot).
        pairs = [part.partition("=") for part in value.split(",") if part.strip()]
        if pairs and all(
            sep and pattern.strip() and style.strip() for pattern, sep, style in pairs
        ):
            return {pattern.strip(): style.strip() for pattern, _, style in pairs}
    elif isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    raise ParallelismConfigError(
        f"parallelism_config: {key} must map module-name patterns to styles such as "
        "colwise/rowwise (in a config file a mapping, on the command line "
        f"'mlp.up=colwise,mlp.down=rowwise'), got {value!r}"
    )


def plain_ep_plan(value: Any, key: str = "ep_plan") -> Any:
    """An ep_plan as config files write it: a list of patterns (or pattern -> style)."""
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [str(p) for p in value]
    raise ParallelismConfigError(
        f"parallelism_config: {key} must list module-name patterns of the experts modules "
        f"(e.g. ['layers.*.mlp.experts']), got {value!r}"
    )


def as_size(key: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ParallelismConfigError(
            f"parallelism_config: {key} must be an integer (or -1), got {value!r}"
        ) from None


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ParallelismConfigError(f"parallelism_config: {key} must be true or false, got {value!r}")
