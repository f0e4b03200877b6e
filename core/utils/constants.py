"""The file names slipstream writes, under Accelerate's constant names (and values).

``save_state`` writes ``model.safetensors`` (``model_1.safetensors`` for a second model),
``optimizer.bin``, ``scheduler.bin``, ``scaler.pt`` and ``random_states_{process}.pkl``;
``save_model`` writes ``model.safetensors`` or shards ``model-00001-of-00002.safetensors``
with ``model.safetensors.index.json`` (``pytorch_model*.bin`` without safetensors).

Example::

    os.path.join(output_dir, SAFE_WEIGHTS_NAME)                      # .../model.safetensors
    SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002")
"""

from __future__ import annotations

from ..accelerator.profiling import PROFILE_PATTERN_NAME
from ..checkpoint.weights import PICKLE_INDEX, PICKLE_WEIGHTS, SAFE_INDEX, SAFE_WEIGHTS

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = PICKLE_WEIGHTS
WEIGHTS_INDEX_NAME = PICKLE_INDEX
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_NAME = SAFE_WEIGHTS
SAFE_WEIGHTS_INDEX_NAME = SAFE_INDEX
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
]
