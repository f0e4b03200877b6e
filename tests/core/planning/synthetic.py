"""A hand-made model profile whose figures are easy to add up in a test.

Parameters (elements): embed 1000 (first unit), layers.0 and layers.1 2000 each (blocks),
norm 10 and head 1000 (last units); every weight but the norm's is split by tensor
parallelism. N = 6010. Per sample: each block saves 10000 bytes (6000 of them split by tp),
the last units 1000 (norm) and 4000 (head, its largest tensor: the logits); a block's input is 1000
bytes, its largest saved tensor 3000. Each block does 1000 forward FLOPs, the head 200 (all
split by tp).
"""

from __future__ import annotations

from torch import nn

from slipstream.parallel.pipeline.layout import PipelineLayout, Unit
from slipstream.planning.model_source import ModelSource
from slipstream.planning.profile import ModelProfile, ParameterInfo, UnitProfile

N = 6010


def profile(seq_len: int = 4) -> ModelProfile:
    parameters = (
        ParameterInfo(1000, True, True, -1, "embed", ""),
        ParameterInfo(2000, True, True, -1, "layers.0", "layers.0"),
        ParameterInfo(2000, True, True, -1, "layers.1", "layers.1"),
        ParameterInfo(10, True, False, -1, "norm", ""),
        ParameterInfo(1000, True, True, -1, "head", ""),
    )
    units = (
        UnitProfile("embed", "pre", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        UnitProfile("layers.0", "block", 10000.0, 6000.0, 1000.0, 3000.0, 1000.0, 1000.0),
        UnitProfile("layers.1", "block", 10000.0, 6000.0, 1000.0, 3000.0, 1000.0, 1000.0),
        UnitProfile("norm", "post", 1000.0, 0.0, 1000.0, 1000.0, 0.0, 0.0),
        UnitProfile("head", "post", 4000.0, 0.0, 1000.0, 4000.0, 200.0, 200.0),
    )
    pipeline = PipelineLayout(
        "declared",
        (
            Unit("embed", 1000, "pre"),
            Unit("layers.0", 2000),
            Unit("layers.1", 2000),
            Unit("norm", 10, "post"),
            Unit("head", 1000, "post"),
        ),
    )
    source = ModelSource("synthetic", "config", {"hidden_size": 4})
    return ModelProfile(source, nn.Identity(), parameters, units, pipeline, seq_len, 4, True)
