"""Gradient accumulation for an elastic job that keeps its global batch.

An elastic job (``slipstream launch --nnodes MIN:MAX`` with ``elastic_batch: global``) gives
``gradient_accumulation_steps`` for its full size; on fewer processes each one accumulates
proportionally more micro-batches, so every optimizer step still sees the same number of
samples. Only the data-parallel dimensions change size in an elastic job (tensor, context
and pipeline sizes are fixed), so the ratio of world sizes is the ratio of data-parallel
sizes.

Example::

    elastic_accumulation_steps(1, world_size=2, reference_world_size=4)  # 2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def elastic_accumulation_steps(steps: int, world_size: int, reference_world_size: int) -> int:
    """The accumulation that keeps ``steps`` x ``reference_world_size`` micro-batches per
    optimizer step on ``world_size`` processes."""
    total = steps * reference_world_size
    if world_size < 1 or total % world_size:
        raise ValueError(
            f"gradient_accumulation_steps={steps} at {reference_world_size} processes cannot "
            f"keep its global batch on {world_size} processes ({total} micro-batches do not "
            "split evenly): choose gradient_accumulation_steps so that they do, or set "
            "elastic_batch: per_process"
        )
    return total // world_size


def accumulation_for_world(steps: int, launch: Mapping[str, Any], world_size: int) -> int:
    """``steps`` adjusted for this job's size when the launcher says the job is elastic and
    keeps its global batch (the launcher's ``elastic`` setting); else ``steps``."""
    elastic = launch.get("elastic")
    if not elastic or elastic.get("batch") != "global":
        return steps
    return elastic_accumulation_steps(steps, world_size, int(elastic["reference_world_size"]))


def resumed_micro_steps(micro_steps: int, saved_world: int | None, world: int) -> int:
    """The epoch's micro-step count saved by ``saved_world`` data-parallel processes, on
    ``world`` of them: the same samples, split over more or fewer processes (the prepared
    dataloaders translate their position the same way). Unchanged when it does not divide
    (the dataloaders then refuse the position themselves) or the size is unknown."""
    if not saved_world or saved_world == world or (micro_steps * saved_world) % world:
        return micro_steps
    return micro_steps * saved_world // world


def describe_resize(
    url: str, saved_step: dict[str, Any], saved_by: int, processes: int, now: Any
) -> str:
    """The one line said when a checkpoint saved by ``saved_by`` processes is loaded on
    ``processes`` (an elastic resize, or a plain resume at another size): the step, the
    sizes, the accumulation change and the processes with no RNG state in it. ``now`` is
    the loading job's step state."""
    steps = int(now.gradient_accumulation_steps)
    before = int(saved_step.get("gradient_accumulation_steps", steps))
    if steps != before:
        batch = f"gradient accumulation {steps} (was {before}) keeps the global batch"
    else:
        batch = f"gradient accumulation {steps} (the global batch changes with the size)"
    text = (
        f"resumed from {url} at step {int(saved_step['optimizer_steps'])}: saved by "
        f"{saved_by} process(es), now {processes}; {batch}"
    )
    if processes > saved_by:
        new = f"{saved_by}" if processes == saved_by + 1 else f"{saved_by}-{processes - 1}"
        text += f"; process(es) {new} had no RNG state in it and keep their own"
    return text
