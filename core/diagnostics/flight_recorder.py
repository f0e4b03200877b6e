"""torch's Flight Recorder, read as plain data: the last collectives torch ran in this
process (DDP's gradient all-reduces, FSDP2's gathers, direct ``torch.distributed`` calls),
with their per-group sequence numbers, sizes, whether they completed, and where they were
called from.

torch records them when ``TORCH_FR_BUFFER_SIZE`` is set before the process group forms
(slipstream sets it: :data:`slipstream.runtime.state.FLIGHT_RECORDER_ENTRIES`); on NCCL
this is torch's Flight Recorder as torchtitan uses it, on gloo (torch 2.8 and later) the
same records. Where torch has none, :func:`read_flight_recorder` returns ``None`` and the
hang report uses slipstream's own log (:mod:`slipstream.runtime.flight`).

Example::

    recorded = read_flight_recorder(last=16)
    if recorded is not None:
        for entry in recorded["entries"]:
            print(entry["group"], entry["seq"], entry["op"], entry["pending"])
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from .stacks import user_frame


def _group_names() -> dict[str, dict[str, Any]]:
    """torch's process groups by name: their description and global ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    world = dist.distributed_c10d._world
    groups: dict[str, dict[str, Any]] = {}
    for group, name in list(world.pg_names.items()):
        ranks = world.pg_group_ranks.get(group, {})
        groups[str(name)] = {
            "ranks": sorted(int(r) for r in ranks),
            "default": group is dist.GroupMember.WORLD,
        }
    return groups


def read_flight_recorder(last: int = 16) -> dict[str, Any] | None:
    """The last ``last`` collectives torch recorded in this process and each group's
    counters, or ``None`` when torch records nothing here."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        dump = pickle.loads(_dump_fr_trace(True, True, False))
    except Exception:  # a torch without a recorder for this backend, or none enabled
        return None
    entries = list(dump.get("entries") or [])
    if not entries and not dump.get("pg_status"):
        return None
    now_ns = time.time_ns()
    parsed = []
    for entry in entries[-last:]:
        group = entry.get("process_group") or ("?", "?")
        frames = [
            {"file": f.get("filename", "?"), "line": f.get("line", 0), "function": f.get("name")}
            for f in reversed(entry.get("frames") or [])
        ]
        site = user_frame(frames)
        op = str(entry.get("profiling_name", "?"))
        parsed.append(
            {
                "group": str(group[0]),
                "group_desc": str(group[1]),
                "seq": int(entry.get("collective_seq_id") or entry.get("p2p_seq_id") or 0),
                "p2p": bool(entry.get("is_p2p", False)),
                "op": op.split(":", 1)[-1],
                "sizes": entry.get("input_sizes"),
                "dtypes": entry.get("input_dtypes"),
                "pending": not entry.get("retired", False) and entry.get("state") != "completed",
                "age": round((now_ns - int(entry.get("time_created_ns") or now_ns)) / 1e9, 3),
                "site": f"{site['file']}:{site['line']}" if site else "?",
            }
        )
    status = {
        str(name): {
            "enqueued": int(values.get("last_enqueued_collective", -1)),
            "completed": int(values.get("last_completed_collective", -1)),
        }
        for name, values in (dump.get("pg_status") or {}).items()
    }
    return {"entries": parsed, "status": status, "groups": _group_names()}
