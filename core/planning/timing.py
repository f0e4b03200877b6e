"""Step time of a layout: its matrix products at a stated efficiency, each collective's bytes
over the links it crosses, the pipeline's bubble, and the optimizer's update.

Per process and optimizer step:

- compute: forward FLOPs of the process's units (traced; 1/tp of what tensor parallelism
  splits, 1/cp of the sequence) x samples x 3 (backward is twice the forward; 4 with full
  recomputation), over ``device FLOP/s x efficiency``;
- collectives: ring volumes (``2 (n-1)/n`` of the bytes for an all-reduce, ``(n-1)/n`` for
  an all-gather or reduce-scatter) over the bandwidth of the group's links (a group whose
  processes sit on several nodes runs at the NIC's rate), plus a latency per call. FSDP's and
  ZeRO's gathers and DDP's gradient all-reduce can hide behind computation on GPUs (only what
  exceeds it is exposed); tensor-parallel, expert and pipeline transfers sit between
  computations and are always exposed; on CPU processes nothing overlaps;
- the bubble: a pipeline's busy time over ``1 - bubble`` (:mod:`.schedules`);
- the update: AdamW reads and writes 28 bytes per trainable parameter of the shard at the
  device's memory bandwidth.

Example::

    prediction = predict_time(profile, layout, cluster)
    prediction.seconds, prediction.parts
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster
from .holdings import holdings, stage_units
from .layouts import Layout
from .profile import ModelProfile
from .schedules import bubble


@dataclass(frozen=True)
class Collective:
    """The bytes one process sends in one kind of collective per step."""

    name: str
    bytes: float
    calls: int
    bandwidth: float
    overlappable: bool

    def seconds(self, latency: float) -> float:
        return self.bytes / self.bandwidth + self.calls * latency


@dataclass(frozen=True)
class TimePrediction:
    """Seconds per optimizer step and their parts."""

    seconds: float
    compute: float
    exposed_communication: float
    overlapped_communication: float
    bubble: float  # seconds idle in the pipeline's bubble
    optimizer: float
    collectives: tuple[Collective, ...]
    #: The quantities calibration fits (FLOPs x bubble factor, bytes/bandwidth, calls, bytes
    #: the update moves).
    features: tuple[float, float, float, float]
    tokens_per_second: float

    def explain(self) -> str:
        parts = [f"compute {self.compute:.3g} s"]
        if self.exposed_communication or self.overlapped_communication:
            parts.append(
                f"communication {self.exposed_communication:.3g} s exposed"
                + (
                    f", {self.overlapped_communication:.3g} s hidden"
                    if self.overlapped_communication
                    else ""
                )
            )
        if self.bubble:
            parts.append(f"bubble {self.bubble:.3g} s")
        parts.append(f"optimizer {self.optimizer:.3g} s")
        return ", ".join(parts)


def _strides(layout: Layout) -> dict[str, int]:
    """Rank distance between neighbours along each mesh dimension (tp innermost)."""
    strides, step = {}, 1
    for dim in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        strides[dim] = step
        step *= getattr(layout, dim)
    return strides


def _collectives(
    profile: ModelProfile, layout: Layout, cluster: Cluster, rank: int
) -> list[Collective]:
    c = 2 if layout.mixed_precision in ("bf16", "fp16") else 4
    h = holdings(profile, layout, rank)
    units = stage_units(profile, layout, rank)
    chosen = [u for u in profile.units if units is None or u.name in units]
    strides = _strides(layout)
    config = profile.config
    hidden = float(config.get("hidden_size") or 0)
    tokens = layout.micro_batch * profile.seq_len / layout.cp  # per micro-batch
    micro = layout.microbatches
    found: list[Collective] = []

    def add(name: str, volume: float, calls: int, stride: int, size: int, overlap: bool) -> None:
        if size > 1 and volume > 0:
            found.append(Collective(name, volume, calls, cluster.bandwidth(stride, size), overlap))

    blocks = sum(1 for u in chosen if u.role == "block")
    if layout.engine == "ddp":
        n = layout.world_size
        add("DDP gradient all-reduce", 2 * (n - 1) / n * 4 * h.trainable,
            max(1, int(4 * h.trainable // (25 * 1024**2))), 1, n, True)  # fmt: skip
    elif layout.engine.startswith("zero"):
        n = layout.world_size
        gathers = 2 if layout.zero_stage == 3 else 1
        add("ZeRO parameter all-gathers", gathers * (n - 1) / n * c * h.total * micro
            if layout.zero_stage == 3 else (n - 1) / n * c * h.total, gathers * (blocks + 1), 1, n, True)  # fmt: skip
        add(
            "ZeRO gradient reduce-scatter",
            (n - 1) / n * c * h.trainable * micro,
            blocks + 1,
            1,
            n,
            True,
        )
    else:
        s = layout.shard_group
        units_count = blocks + 1
        once = layout.accumulation > 1 or layout.pp > 1  # kept gathered across micro-batches
        gathers = 1 if once else 2 * micro
        add("FSDP parameter all-gathers", gathers * (s - 1) / s * c * h.total,
            gathers * units_count, strides["cp"], s, True)  # fmt: skip
        scatters = 1 if once else micro
        add("FSDP gradient reduce-scatter", scatters * (s - 1) / s * 4 * h.trainable,
            scatters * units_count, strides["cp"], s, True)  # fmt: skip
        r = layout.dp_replicate
        add("HSDP replica all-reduce", 2 * (r - 1) / r * 4 * h.sharded_trainable, units_count,
            strides["dp_replicate"], r, True)  # fmt: skip
    t = layout.tp
    activation = tokens * hidden * c
    add("TP activation all-reduces", micro * 4 * blocks * 2 * (t - 1) / t * activation,
        micro * 4 * blocks, 1, t, False)  # fmt: skip
    if layout.ep > 1:
        top_k = float(config.get("num_experts_per_tok") or 1)
        moe = sum(1 for u in chosen if u.role == "block")
        e = layout.ep
        add("EP token all-to-alls", micro * 4 * moe * (e - 1) / e * tokens * top_k * hidden * c,
            micro * 4 * moe, strides["cp"], e, False)  # fmt: skip
    if layout.pp > 1:
        add("PP activation sends", micro * 2 * activation * layout.pp_stages_per_rank,
            micro * 2 * layout.pp_stages_per_rank, strides["pp"], 2, False)  # fmt: skip
    if layout.cp > 1:
        kv = (
            float(config.get("num_key_value_heads") or 1)
            * hidden
            / float(config.get("num_attention_heads") or 1)
        )
        cp = layout.cp
        add("CP key/value all-gathers", micro * blocks * 4 * (cp - 1) * tokens * kv * c,
            micro * blocks * 2, strides["cp"], cp, False)  # fmt: skip
    return found


def predict_time(profile: ModelProfile, layout: Layout, cluster: Cluster) -> TimePrediction:
    """Seconds per optimizer step of the layout's slowest process."""
    device = cluster.device
    rate = device.flops(layout.mixed_precision) * device.efficiency
    best: TimePrediction | None = None
    for rank in range(layout.pp):
        units = stage_units(profile, layout, rank)
        chosen = [u for u in profile.units if units is None or u.name in units]
        samples = layout.micro_batch * layout.microbatches
        passes = 4.0 if layout.recompute == "full" else 3.0
        flops = sum(u.forward_flops(layout.tp) for u in chosen) / layout.cp * samples * passes
        compute = flops / rate
        collectives = _collectives(profile, layout, cluster, rank)
        hidden_part = sum(c.seconds(device.latency) for c in collectives if c.overlappable)
        always = sum(c.seconds(device.latency) for c in collectives if not c.overlappable)
        if device.overlaps:
            exposed = always + max(0.0, hidden_part - compute)
            overlapped = min(hidden_part, compute)
        else:
            exposed, overlapped = always + hidden_part, 0.0
        busy = compute + exposed
        idle = bubble(layout.pp_schedule, layout.pp, layout.pp_microbatches,
                      layout.pp_stages_per_rank)  # fmt: skip
        waiting = busy * idle / (1 - idle)
        h = holdings(profile, layout, rank)
        moved = 28.0 * (h.sharded_trainable if layout.engine != "ddp" else h.trainable)
        optimizer = moved / device.memory_bw
        seconds = busy + waiting + optimizer
        volume = sum(c.bytes / c.bandwidth for c in collectives)
        calls = float(sum(c.calls for c in collectives))
        tokens = layout.samples_per_step * profile.seq_len
        prediction = TimePrediction(
            seconds=seconds,
            compute=compute,
            exposed_communication=exposed,
            overlapped_communication=overlapped,
            bubble=waiting,
            optimizer=optimizer,
            collectives=tuple(collectives),
            features=(flops / (1 - idle), volume / (1 - idle), calls / (1 - idle), moved),
            tokens_per_second=tokens / seconds,
        )
        if best is None or prediction.seconds > best.seconds:
            best = prediction
    assert best is not None
    return best
