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


def schedule_name(name: str) -> str:
    """slipstream's name for a pipeline schedule (torch's class names are accepted too)."""
    lowered = str(name).strip().lower().replace("-", "_")
    for ours, theirs in PIPELINE_SCHEDULES.items():
        if lowered in (ours, theirs.lower(), theirs.lower().removeprefix("schedule")):
            return ours
    raise ParallelismConfigError(
        f"unknown pipeline schedule {name!r}; use one of {', '.join(PIPELINE_SCHEDULES)}"
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
