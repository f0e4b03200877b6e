"""The plan (:class:`Plan`, what :func:`slipstream.plan` returns) as people read it: a header naming the model, the cluster and the batch, a ranked
table (one row per layout) and under each row where its memory and time figures come from.

Example::

    print(format_plan(plan, top=5))
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from .candidates import Candidate
from .hardware import Cluster
from .profile import ModelProfile

_MiB = 1024**2
_GiB = 1024**3


@dataclass
class Plan(Sequence[Candidate]):
    """The candidates that fit, fastest first (a sequence), and what the plan considered."""

    model: str
    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    seq_len: int
    candidates: list[Candidate]
    considered: int
    #: When nothing fits: what would (one line each).
    suggestions: list[str]
    #: Notes on the figures (calibration used, assumptions).
    notes: list[str]
    #: The smallest candidates that do not fit (when none fits), for the table.
    closest: list[Candidate]

    @overload
    def __getitem__(self, index: int) -> Candidate: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Candidate]: ...
    def __getitem__(self, index: int | slice) -> Candidate | Sequence[Candidate]:
        return self.candidates[index]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.candidates)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def table(self, top: int = 10) -> str:
        """The plan as text (see :func:`format_plan`)."""
        return format_plan(self, top)


def format_size(size: float) -> str:
    """``size`` bytes in KiB, MiB or GiB (binary units)."""
    if size >= _GiB:
        return f"{size / _GiB:,.1f} GiB"
    return f"{size / _MiB:,.0f} MiB" if size >= _MiB else f"{size / 1024:,.1f} KiB"


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _header(plan: Plan) -> list[str]:
    profile, cluster = plan.profile, plan.cluster
    device = cluster.device
    limit = device.memory * device.usable
    precision = "fp32" if profile.compute_bytes == 4 else "bf16"
    return [
        f"Plan for {profile.name} ({profile.parameter_count / 1e9:,.3f}B parameters, "
        f"{profile.blocks} blocks) from {plan.model}",
        f"on {cluster.describe()}",
        f"global batch {plan.global_batch} x {plan.seq_len} tokens, {precision}, AdamW; "
        f"{plan.considered} layouts considered, {len(plan)} fit in {format_size(limit)} per "
        f"device ({device.usable:.0%} of {format_size(device.memory)})",
        *plan.notes,
    ]


def _row(index: str, candidate: Candidate) -> list[str]:
    layout = candidate.layout
    return [
        index,
        candidate.describe(),
        f"{layout.micro_batch} x {layout.microbatches}",
        format_size(candidate.memory.peak),
        format_seconds(candidate.time.seconds),
        f"{candidate.time.tokens_per_second:,.0f}",
    ]


def _reasons(candidate: Candidate, width: int) -> list[str]:
    memory = "memory: " + candidate.memory.explain()
    time = "time: " + candidate.time.explain()
    communication = ", ".join(
        f"{c.name} {format_size(c.bytes)} at {c.bandwidth / 1e9:,.0f} GB/s"
        for c in candidate.time.collectives
    )
    if communication:
        time += f" ({communication})"
    lines = []
    for text in (memory, time):
        lines += textwrap.wrap(text, width, initial_indent="      ", subsequent_indent="        ")
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    aligned = []
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2])]
        cells += [cell.rjust(width) for cell, width in zip(row[3:], widths[3:], strict=True)]
        aligned.append("  ".join(cells))
    return aligned


def format_plan(plan: Plan, top: int = 10, width: int = 100) -> str:
    """The plan as text: header, then the ``top`` candidates with their reasons."""
    lines = _header(plan)
    heading = ["#", "layout", "batch (mb x n)", "peak memory", "step time", "tokens/s"]
    if plan.suggestions:
        lines.append("")
        lines += [textwrap.fill(s, width, subsequent_indent="  ") for s in plan.suggestions]
    shown = list(plan)[:top]
    if not shown and plan.closest:
        lines += ["", "closest (does not fit):"]
        shown = list(plan.closest)
    if shown:
        rows = [heading, *(_row(str(i + 1), c) for i, c in enumerate(shown))]
        table = _table(rows)
        lines += ["", table[0], "-" * len(table[0])]
        for text, candidate in zip(table[1:], shown, strict=True):
            lines.append(text)
            lines += _reasons(candidate, width)
    lines += [
        "",
        "Memory: the peak of the hungriest process (binary units); time: per optimizer step. "
        "`slipstream plan --verify` measures them on this machine's CPU.",
    ]
    return "\n".join(lines)


def plan_as_dict(plan: Plan, top: int = 10) -> dict[str, Any]:
    """The plan for ``--json``."""

    def entry(c: Candidate) -> dict[str, Any]:
        return {
            "layout": c.layout.as_dict(),
            "fits": c.fits,
            "peak_bytes": c.memory.peak,
            "memory_phase": c.memory.phase,
            "memory_parts": [
                {"name": p.name, "bytes": p.bytes, "why": p.why} for p in c.memory.parts
            ],
            "host_bytes": c.memory.host,
            "step_seconds": c.time.seconds,
            "tokens_per_second": c.time.tokens_per_second,
            "time": c.time.explain(),
            "parallelism_config": c.parallelism,
        }

    return {
        "model": plan.model,
        "parameters": plan.profile.parameter_count,
        "cluster": plan.cluster.describe(),
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "considered": plan.considered,
        "fitting": len(plan),
        "candidates": [entry(c) for c in list(plan)[:top]],
        "closest": [entry(c) for c in plan.closest],
        "suggestions": plan.suggestions,
        "notes": plan.notes,
    }
