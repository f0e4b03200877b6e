"""Peak memory of one process of a layout: the largest of the moments of a training step,
each the sum of what is alive then.

The moments: the end of the forward pass (every micro-batch in flight holds its
activations, and backward starts with the loss's gradient), the end of backward (every
gradient exists; the embedding's dense gradient is being made), and the optimizer step
(parameters, gradients, optimizer states and the update's temporaries). Under a pipeline
the process's own schedule is walked: activations of the micro-batches it holds, gradients
from its first backward on.

What each engine keeps (fp32 parameters and AdamW states; compute in ``c`` bytes):

- DDP: parameters 4 B, gradients 4 B and a bucket copy of them 4 B (gradient_as_bucket_view
  is off), states 8 B per parameter; autocast keeps a ``c``-byte copy of the weights.
- FSDP2 (tp/pp/ep/cp combine with it): 4 + 4 + 8 B per parameter of its shard; gathered in
  ``c`` bytes: the root unit (embedding, norm, head) from forward to the end of backward, the
  block computing and the one prefetched. When it does not reshard between micro-batches
  (gradient accumulation, pipelines) the whole stage stays gathered and its unsharded
  gradients accumulate.
- DeepSpeed: ZeRO-3 keeps a partition of parameters (``c`` B), fp32 master (4 B), states
  (8 B) and gradients (``c`` B); ZeRO-1/2 keep whole parameters, shard the states and keep
  the gradient partition (4 B; DeepSpeed reduces gradients in buckets during backward at
  both stages); live parameters and buckets, and on CPU its shared-memory workspace.

Activations come from the model's trace (:mod:`slipstream.planning.tracing`), per sample,
scaled by the micro-batch, divided by cp, and for the tensor-parallel part by tp. The loss's
backward adds two tensors the size of the largest saved one (the log-probabilities' and the
logits' gradients); on the host the first, zeros with one entry a row, costs nothing until
written, so one is counted there.

Example::

    prediction = predict_memory(profile, layout, preset("H100"))
    prediction.peak, prediction.phase, [part.name for part in prediction.parts]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .hardware import Device
from .holdings import Holdings, holdings, stage_units
from .layouts import Layout
from .profile import ModelProfile, UnitProfile
from .schedules import actions

_MiB = 1024**2


@dataclass(frozen=True)
class Part:
    """One kind of memory at the peak moment, with where its figure comes from."""

    name: str
    bytes: float
    why: str


@dataclass(frozen=True)
class MemoryPrediction:
    """The peak of the process of the layout that needs the most."""

    peak: float
    phase: str
    #: Which process: "every process", or "pipeline rank r" under a pipeline.
    where: str
    parts: tuple[Part, ...]
    #: Bytes each process keeps in host memory (offload).
    host: float = 0.0

    def part(self, name: str) -> float:
        return sum(p.bytes for p in self.parts if p.name == name)

    def explain(self) -> str:
        shown = [f"{p.name} {p.bytes / _MiB:,.0f} MiB ({p.why})" for p in self.parts if p.bytes]
        return f"{self.phase}, {self.where}: " + "; ".join(shown)


def _millions(elements: float) -> str:
    return f"{elements / 1e6:,.1f}M" if elements >= 1e5 else f"{elements:,.0f}"


@dataclass(frozen=True)
class _Activations:
    per_microbatch: float  # what one micro-batch in flight keeps
    transient: float  # backward's first working set (the loss gradient's size)
    outputs: float  # the outputs one micro-batch leaves held (logits)
    why: str


def _activations(
    profile: ModelProfile, layout: Layout, units: set[str] | None, lazy_zeros: bool
) -> _Activations:
    chosen = [u for u in profile.units if units is None or u.name in units]
    scale = layout.micro_batch / layout.cp
    blocks = [u for u in chosen if u.role == "block"]
    others = [u for u in chosen if u.role != "block"]
    if layout.recompute == "full" and blocks:
        kept = sum(u.inputs for u in blocks) + sum(u.activations(layout.tp) for u in others)
        kept += max(u.activations(layout.tp) for u in blocks)  # the block recomputed
        why = "block inputs kept, one block recomputed"
    elif layout.recompute == "selective" and blocks:
        kept = sum(u.selective_activations(layout.tp) for u in blocks)
        kept += sum(u.activations(layout.tp) for u in others)
        kept += max(u.activations(layout.tp) - u.selective_activations(layout.tp) for u in blocks)
        why = "every other product's output kept, one block's rest recomputed"
    else:
        kept = sum(u.activations(layout.tp) for u in chosen)
        why = "saved for backward, traced"
    posts = [u for u in chosen if u.role == "post"]
    largest = max((u.largest for u in (posts or chosen)), default=0.0)
    outputs = max((u.largest for u in posts), default=0.0)
    # Backward of the loss: the gradient of the log-probabilities (zeros with one entry a
    # row) and of the logits, each the size of the largest saved tensor.
    working = 1 if lazy_zeros or not posts else 2
    return _Activations(kept * scale, working * largest * scale, outputs * scale, why)


def _phase(name: str, parts: Iterable[Part]) -> tuple[float, str, tuple[Part, ...]]:
    kept = tuple(p for p in parts if p.bytes > 0)
    return sum(p.bytes for p in kept), name, kept


def _state(layout: Layout, h: Holdings, c: int, device: Device) -> tuple[list[Part], Part, Part]:
    """What rests between steps (parts), the gradients when they exist, and the optimizer
    step's temporaries."""
    engine = layout.engine
    offload = layout.offload != "none"
    if engine == "fsdp" and layout.data_parallel * layout.cp > 1:
        n, t = h.sharded, h.sharded_trainable
        shard = f"1/{layout.shard_group} of {_millions(h.total)} (FSDP2 shards)"
        rest = [
            Part("parameters", 0 if offload else 4 * n, f"4 B x {_millions(n)}, {shard}"),
            Part("optimizer states", 0 if offload else 8 * t, f"AdamW 8 B x {_millions(t)}"),
        ]
        grads = Part("gradients", 0 if offload else 4 * t, f"4 B x {_millions(t)} (sharded)")
        largest = h.largest_sharded_parameter
    elif engine.startswith("zero"):
        # DeepSpeed reduces gradients in buckets during backward at every stage and keeps
        # only its partition (4 B; measured: ZeRO-1 holds about what ZeRO-2 does, not the
        # whole gradients the ZeRO paper's stage 1 keeps); in fp32 no separate master copy
        # below stage 3.
        stage, n, t = layout.zero_stage, h.sharded, h.sharded_trainable
        held = n if stage == 3 else h.total
        master = 0 if c == 4 and stage < 3 else 4 * t
        grad_bytes = c if stage == 3 else 4
        rest = [
            Part("parameters", c * held, f"{c} B x {_millions(held)}"),
            Part("optimizer states", 0 if offload else 8 * t + master,
                 f"AdamW 8 B{' + fp32 master 4 B' if master else ''} x {_millions(t)} "
                 f"(1/{layout.world_size})"),
            Part("gradients", grad_bytes * t, f"{grad_bytes} B x {_millions(t)}, the partition"),
        ]  # fmt: skip
        grads = Part("gradients", 0, "")
        largest = t
    else:
        n, t = h.total, h.trainable
        rest = [
            Part("parameters", 4 * n, f"4 B x {_millions(n)}" + (
                f" (1/{layout.tp} of split weights)" if layout.tp > 1 else "")),
            Part("optimizer states", 8 * t, f"AdamW 8 B x {_millions(t)}"),
        ]  # fmt: skip
        if engine == "ddp":
            rest.append(Part("communication buffers", 4 * t, "DDP's gradient buckets, 4 B each"))
        grads = Part("gradients", 4 * t, f"4 B x {_millions(t)}")
        largest = h.largest_parameter
    if offload:
        temporaries = Part("optimizer temporaries", 0, "on the host")
    elif device.foreach_optimizer:
        temporaries = Part("optimizer temporaries", 4 * t, "foreach AdamW: one fp32 copy")
    else:
        temporaries = Part("optimizer temporaries", 8 * largest,
                           f"AdamW: 2 x 4 B x the largest tensor ({_millions(largest)})")  # fmt: skip
    return rest, grads, temporaries


def _gathered(
    layout: Layout, h: Holdings, c: int, buckets: int, workspace: float
) -> tuple[Part, Part]:
    """Weights gathered to compute (forward/backward) and gradients in flight (backward)."""
    engine = layout.engine
    if engine == "fsdp" and layout.data_parallel * layout.cp > 1:
        if layout.accumulation > 1 or layout.pp > 1:
            # No resharding between micro-batches: the stage stays whole, gradients unsharded.
            return (
                Part("gathered weights", c * h.total, f"{c} B x {_millions(h.total)}: kept "
                     "gathered between micro-batches"),
                Part("gradients in flight", c * h.trainable,
                     "unsharded, accumulated until the last micro-batch"),
            )  # fmt: skip
        units = h.root + 2 * h.largest_block + 2 * h.largest_experts
        return (
            Part("gathered weights", c * units, f"{c} B x (root unit {_millions(h.root)} + 2 x "
                 f"block {_millions(h.largest_block)}" + (
                     f" + 2 x experts {_millions(h.largest_experts)}" if h.largest_experts
                     else "") + ")"),
            Part("gradients in flight", c * h.post, "the head's unsharded gradient"),
        )  # fmt: skip
    if engine == "zero3":
        # Live and prefetched parameters, and the reduce and all-gather buckets, each the
        # bucket size the planner's DeepSpeed config sets.
        return (
            Part("gathered weights", 2 * c * buckets, f"live + prefetched, 2 x {_millions(buckets)}"),
            Part("communication buffers", 2 * c * buckets + workspace,
                 f"reduce and all-gather buckets, 2 x {_millions(buckets)}"
                 + (f", DeepSpeed's workspace {workspace / _MiB:.0f} MiB" if workspace else "")),
        )  # fmt: skip
    if engine.startswith("zero"):
        return (
            Part("gathered weights", 0, ""),
            Part("communication buffers", 2 * c * buckets + workspace,
                 f"reduce and all-gather buckets, 2 x {_millions(buckets)}"
                 + (f", DeepSpeed's workspace {workspace / _MiB:.0f} MiB" if workspace else "")),
        )  # fmt: skip
    if c < 4:
        return (Part("gathered weights", c * h.total, "autocast's copies of the weights"),
                Part("gradients in flight", 0, ""))  # fmt: skip
    return Part("gathered weights", 0, ""), Part("gradients in flight", 0, "")


def _rank(
    profile: ModelProfile, layout: Layout, device: Device, rank: int, buckets: int
) -> tuple[float, str, tuple[Part, ...], float]:
    c = 2 if layout.mixed_precision in ("bf16", "fp16") else 4
    h = holdings(profile, layout, rank)
    units = stage_units(profile, layout, rank)
    act = _activations(profile, layout, units, device.lazy_zeros)
    rest, grads, temporaries = _state(layout, h, c, device)
    gathered, in_flight = _gathered(layout, h, c, buckets, device.deepspeed_workspace)
    runtime = Part("runtime", device.runtime_overhead, f"{device.name} process overhead")
    holds_last = units is None or any(u.role == "post" and u.name in units for u in profile.units)
    chunks = layout.pp_stages_per_rank
    per_chunk = act.per_microbatch / chunks
    phases = []
    if layout.pp == 1:
        held = layout.micro_batch
        phases.append(_phase("end of forward", [*rest, runtime, gathered, in_flight,
            Part("activations", act.per_microbatch, f"{held} sample(s), {act.why}"),
            Part("transient", act.transient, "the loss gradient")]))  # fmt: skip
        phases.append(_phase("end of backward", [*rest, runtime, gathered, grads,
            Part("activations", act.outputs, "the outputs, held"),
            Part("transient", c * h.largest_parameter, "the embedding's dense gradient")]))  # fmt: skip
    else:
        order = actions(layout.pp_schedule, layout.pp, rank, layout.pp_microbatches, chunks)
        sharded = layout.engine == "fsdp" and layout.data_parallel * layout.cp > 1
        accumulated = in_flight if sharded else grads  # gradients from the first backward on
        outputs = (layout.pp_microbatches - 1) * act.outputs if holds_last else 0.0
        flying, backward_done = 0, False
        for kind, _, _ in order:
            if kind == "F":
                flying += 1
                continue
            parts = [*rest, runtime, gathered,
                     Part("activations", flying * per_chunk,
                          f"{flying} micro-batch chunk(s) in flight, {act.why}"),
                     Part("activations", outputs, "the last stage's outputs, kept"),
                     Part("transient", act.transient, "the loss gradient")]  # fmt: skip
            if backward_done:
                parts.append(accumulated)
            phases.append(_phase(f"backward with {flying} in flight", parts))
            flying -= 1
            backward_done = True
    phases.append(_phase("optimizer step", [*rest, runtime, grads, temporaries] + (
        [Part("activations", layout.pp_microbatches * act.outputs, "the last stage's outputs")]
        if layout.pp > 1 and holds_last else [])))  # fmt: skip
    peak, name, kept = max(phases, key=lambda phase: phase[0])
    host = 16.0 * h.sharded_trainable if layout.offload != "none" else 0.0
    return peak, name, kept, host


def predict_memory(
    profile: ModelProfile, layout: Layout, device: Device, buckets: int = 0
) -> MemoryPrediction:
    """The peak bytes of the layout's hungriest process (``buckets``: DeepSpeed's bucket
    elements)."""
    best: MemoryPrediction | None = None
    for rank in range(layout.pp):
        peak, phase, parts, host = _rank(profile, layout, device, rank, buckets)
        where = f"pipeline rank {rank}" if layout.pp > 1 else "every process"
        if best is None or peak > best.peak:
            best = MemoryPrediction(peak, phase, where, parts, host)
    assert best is not None
    return best


def activation_bytes(profile: ModelProfile, layout: Layout, unit: UnitProfile) -> float:
    """One unit's activations for one micro-batch of the layout."""
    return unit.activations(layout.tp) * layout.micro_batch / layout.cp
