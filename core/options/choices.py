"""Named choices, with Accelerate's names and values: precisions, trackers, compile backends,
random number generators, compute environments.

Each is a ``str`` enum (``PrecisionType.BF16 == "bf16"``) whose ``str()`` is its value;
``"bf16" in PrecisionType`` tests a value, ``PrecisionType.list()`` lists them.

Example::

    Accelerator(mixed_precision=PrecisionType.BF16, log_with=LoggerType.TENSORBOARD)
    synchronize_rng_states([RNGType.TORCH, RNGType.GENERATOR], generator=generator)
"""

from __future__ import annotations

import enum
from typing import Any


class _ContainsValues(enum.EnumMeta):
    def __contains__(cls, item: Any) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class ChoiceEnum(str, enum.Enum, metaclass=_ContainsValues):
    """A ``str`` enum printed as its value."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> list[str]:
        """Every value, in definition order."""
        return [str(member) for member in cls]


class PrecisionType(ChoiceEnum):
    """``mixed_precision`` values: ``no`` (fp32), ``fp8``, ``fp16``, ``bf16``."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class LoggerType(ChoiceEnum):
    """Experiment trackers for ``log_with``. slipstream has ``csv``, ``tensorboard``,
    ``wandb`` and ``mlflow`` built in (``all``: those installed); the others name
    Accelerate's trackers and are refused by ``log_with`` (pass a ``GeneralTracker``)."""

    ALL = "all"
    CSV = "csv"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class DynamoBackend(ChoiceEnum):
    """``torch.compile`` backends (``TorchDynamoPlugin(backend=...)``, ``dynamo_backend``)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class RNGType(ChoiceEnum):
    """Random number generators to synchronise (``synchronize_rng_states``). slipstream runs
    on CPUs and CUDA GPUs: ``torch``, ``cuda`` and ``generator`` apply there."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class ComputeEnvironment(ChoiceEnum):
    """Where a job runs (the config file's ``compute_environment``)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"
