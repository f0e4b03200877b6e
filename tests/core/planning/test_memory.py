"""The memory model's arithmetic against figures added up by hand (tests/core/planning/
synthetic.py describes the model), one layout family at a time."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.planning.hardware import preset
from slipstream.planning.holdings import holdings
from slipstream.planning.layouts import Layout
from slipstream.planning.memory import predict_memory
from tests.core.planning.synthetic import N, profile

CPU = dataclasses.replace(preset("CPU"), runtime_overhead=0)  # single-tensor AdamW
FP32 = {"mixed_precision": "no"}


def _peak(layout: Layout, buckets: int = 0) -> tuple[float, str]:
    prediction = predict_memory(profile(), layout, CPU, buckets)
    assert prediction.peak == sum(part.bytes for part in prediction.parts)
    return prediction.peak, prediction.phase


def test_holdings_split_shard_and_stage():
    model = profile()
    whole = holdings(model, Layout(dp_shard=2, **FP32))
    # Each parameter padded to whole shards: 500 + 1000 + 1000 + 5 + 500.
    assert (whole.total, whole.sharded, whole.root, whole.post) == (N, 3005, 2010, 1010)
    assert (whole.largest_block, whole.largest_parameter, whole.largest_sharded_parameter) == (
        2000, 2000, 1000,
    )  # fmt: skip
    # tp 2 halves every weight but the norm's: 500 + 1000 + 1000 + 10 + 500.
    assert holdings(model, Layout(tp=2, **FP32)).total == 3010
    # Two stages balanced by parameters: embed + layers.0 | layers.1 + norm + head.
    pipeline = Layout(pp=2, pp_microbatches=2, **FP32)
    assert holdings(model, pipeline, 0).total == 3000
    assert holdings(model, pipeline, 1).total == 3010
    # ZeRO pads the flattened whole: ceil(6010 / 4).
    assert holdings(model, Layout(dp_shard=4, engine="zero3", **FP32)).sharded == 1503


def test_ddp():
    # Rest: 4 N parameters + 8 N AdamW + 4 N buckets = 96160. End of forward: + 2 samples x
    # (10000 + 10000 + 1000 + 4000) activations + 2 x 4000 (the loss gradient) = 154160.
    assert _peak(Layout(dp_replicate=2, engine="ddp", micro_batch=2, **FP32)) == (
        154160, "end of forward",
    )  # fmt: skip
    # One sample: the optimizer step wins: rest + 4 N gradients + 2 x 4 B x 2000 = 136200.
    assert _peak(Layout(dp_replicate=2, engine="ddp", micro_batch=1, **FP32)) == (
        136200, "optimizer step",
    )  # fmt: skip


def test_fsdp():
    # Rest 12 x 3005 = 36060; gathered 4 B x (root 2010 + 2 blocks x 2000) = 24040; the
    # head's unsharded gradient 4 x 1010; activations 50000; loss gradient 8000.
    assert _peak(Layout(dp_shard=2, micro_batch=2, **FP32)) == (122140, "end of forward")


def test_full_recomputation_keeps_block_inputs_and_one_block():
    # Activations per sample: inputs 2 x 1000 + norm and head 5000 + one block 10000.
    assert _peak(Layout(dp_shard=2, micro_batch=2, recompute="full", **FP32)) == (
        122140 - 50000 + 2 * 17000, "end of forward",
    )  # fmt: skip


def test_accumulation_keeps_the_stage_gathered():
    # Gathered 4 x 6010 and unsharded gradients 4 x 6010, with one sample's activations.
    assert _peak(Layout(dp_shard=2, micro_batch=1, accumulation=2, **FP32)) == (
        36060 + 2 * 4 * N + 25000 + 4000, "end of forward",
    )  # fmt: skip


def test_tensor_parallel():
    # Rest 12 x 3010; activations per sample: blocks 4000 + 3000 each (60% split), norm and
    # head 5000: 19000 x 2 samples; loss gradient 8000.
    assert _peak(Layout(tp=2, micro_batch=2, **FP32)) == (36120 + 38000 + 8000, "end of forward")


def test_pipeline_walks_the_schedule():
    # Rank 1 (layers.1, norm, head; 12 x 3010 at rest) at its second backward: one
    # micro-batch in flight (15000), the first one's logits kept (4000), the loss gradient
    # (4000), gradients since the first backward (4 x 3010). Its optimizer step: rest +
    # gradients + 2 x 4 B x 2000 + both micro-batches' logits: 72160, the peak.
    layout = Layout(pp=2, micro_batch=1, pp_microbatches=2, **FP32)
    prediction = predict_memory(profile(), layout, CPU)
    assert (prediction.peak, prediction.phase, prediction.where) == (
        72160, "optimizer step", "pipeline rank 1",
    )  # fmt: skip


def test_zero3_partitions_and_buckets():
    # 4 B parameters + 12 B states + 4 B gradients on ceil(6010 / 2) = 3005; 4 buckets of
    # 100 elements and DeepSpeed's 66 MiB CPU workspace; activations 50000, loss gradient 8000.
    assert _peak(Layout(dp_shard=2, engine="zero3", micro_batch=2, **FP32), buckets=100) == (
        20 * 3005 + 4 * 4 * 100 + 66 * 1024**2 + 50000 + 8000, "end of forward",
    )  # fmt: skip


def test_bf16_gathers_in_two_bytes_and_keeps_fp32_states():
    bf16 = Layout(dp_shard=2, micro_batch=1, mixed_precision="bf16")
    prediction = predict_memory(profile(), bf16, CPU)
    assert prediction.part("gathered weights") == 2 * 6010
    assert prediction.part("optimizer states") == 8 * 3005


def test_offload_moves_the_state_to_the_host():
    layout = Layout(dp_shard=2, micro_batch=1, offload="all", **FP32)
    prediction = predict_memory(profile(), layout, CPU)
    assert prediction.part("parameters") == prediction.part("optimizer states") == 0
    assert prediction.host == 16 * 3005


@pytest.mark.parametrize("sizes", [{"dp_shard": 2, "tp": 3}, {"engine": "ddp", "dp_shard": 2}])
def test_layouts_refuse_what_slipstream_cannot_run(sizes):
    from slipstream.options.errors import ConfigError

    with pytest.raises(ConfigError):
        Layout(**{"engine": "zero3", **sizes}) if "tp" in sizes else Layout(**sizes)
