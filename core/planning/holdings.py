"""What one process of a layout holds of a model's parameters (element counts): its pipeline
stages' share, 1/tp of what tensor parallelism splits, 1/ep of the experts, and the shard
the engine keeps of that (FSDP2 pads each parameter to whole shards; DeepSpeed pads the
flattened whole).

Example::

    share = holdings(profile, Layout(dp_shard=4), pp_rank=0)
    share.sharded, share.largest_block
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import Layout
from .profile import ModelProfile


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Holdings:
    """Parameter elements of one process (after tp, ep and pp; before sharding, unless
    named ``sharded``)."""

    total: int
    trainable: int
    #: Of ``total``: the parameters outside every block and experts module (FSDP's root
    #: unit), and those of the last units (the head, trained first in backward).
    root: int
    post: int
    #: The largest block (decoder layer) and the largest experts module.
    largest_block: int
    largest_experts: int
    #: The largest single parameter (the optimizer's temporaries are this size).
    largest_parameter: int
    #: What the engine keeps at rest: every parameter padded to whole shards.
    sharded: int
    sharded_trainable: int
    largest_sharded_parameter: int


def stage_units(profile: ModelProfile, layout: Layout, pp_rank: int) -> set[str] | None:
    """The pipeline units process ``pp_rank`` holds (None: the whole model)."""
    if layout.pp == 1:
        return None
    from ..parallel.pipeline.runtime import PipelinePlan

    count = layout.pp * layout.pp_stages_per_rank
    stages = profile.stages(count)
    if stages is None:
        raise ValueError(f"{profile.name} cannot be split into {count} pipeline stages")
    plan = PipelinePlan(layout.pp_schedule, layout.pp_microbatches, layout.pp_stages_per_rank,
                        layout.pp)  # fmt: skip
    return {unit for index in plan.stages_of(pp_rank) for unit in stages[index]}


def holdings(profile: ModelProfile, layout: Layout, pp_rank: int = 0) -> Holdings:
    """The parameters process ``pp_rank`` of the pipeline (any, without one) holds."""
    units = stage_units(profile, layout, pp_rank)
    zero = layout.engine.startswith("zero")
    shards = layout.shard_group if layout.engine == "fsdp" else 1
    total = trainable = root = post = largest = sharded = sharded_trainable = 0
    largest_shard = 0
    blocks: dict[str, int] = {}
    experts: dict[int, int] = {}
    post_units = {u.name for u in profile.units if u.role == "post"}
    for p in profile.parameters:
        if units is not None and p.unit not in units:
            continue
        local = _ceil(p.elements, layout.tp) if p.tp_split else p.elements
        over = shards
        if p.expert >= 0 and layout.ep > 1:
            local = _ceil(local, layout.ep)
            over = max(1, shards // layout.ep)
        shard = _ceil(local, over)
        total += local
        trainable += local if p.trainable else 0
        sharded += shard
        sharded_trainable += shard if p.trainable else 0
        largest = max(largest, local)
        largest_shard = max(largest_shard, shard)
        if p.expert >= 0:
            experts[p.expert] = experts.get(p.expert, 0) + local
        elif p.block:
            blocks[p.block] = blocks.get(p.block, 0) + local
        else:
            root += local
        if p.unit in post_units:
            post += local
    if zero:
        # DeepSpeed flattens the parameters and pads the whole to equal partitions.
        group = layout.world_size
        sharded = _ceil(total, group) if layout.zero_stage == 3 else total
        sharded_trainable = _ceil(trainable, group)
        largest_shard = sharded_trainable
    return Holdings(
        total=total,
        trainable=trainable,
        root=root,
        post=post,
        largest_block=max(blocks.values(), default=0),
        largest_experts=max(experts.values(), default=0),
        largest_parameter=largest,
        sharded=sharded,
        sharded_trainable=sharded_trainable,
        largest_sharded_parameter=largest_shard,
    )
