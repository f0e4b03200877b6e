"""What this environment has: optional packages, torch's version, devices and number formats.

Accelerate's ``is_*_available`` checks under the same names. A package counts as available
when it can be imported *and* is installed as a distribution (a stray folder of the same
name does not count); nothing is imported to find out, except where a device check needs
the device's torch extension.

Example::

    if is_wandb_available():
        accelerator = Accelerator(log_with="wandb")
    is_torch_version(">=", "2.4")        # True
    compare_versions("numpy", "<", "3")
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..runtime.env import patch_environment

if TYPE_CHECKING:
    from packaging.version import Version

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def parse(version: str) -> Version:
    """``packaging``'s version of ``version`` (torch's bundled copy when it is not installed)."""
    try:
        from packaging.version import parse as parse_version
    except ImportError:  # pragma: no cover - packaging is nearly always installed
        from torch._vendor.packaging.version import parse as parse_version  # type: ignore[assignment]
    return parse_version(version)


def is_package_available(
    name: str, *distributions: str, min_version: str | None = None, below: str | None = None
) -> bool:
    """Whether the module ``name`` can be imported and one of ``distributions`` (by default
    ``name`` itself) is installed, at ``min_version`` or later and before ``below``."""
    try:
        if importlib.util.find_spec(name) is None:
            return False
    except (ImportError, ValueError):
        return False
    for distribution in distributions or (name,):
        try:
            version = parse(importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
        return (min_version is None or version >= parse(min_version)) and (
            below is None or version < parse(below)
        )
    return False


def compare_versions(
    library_or_version: str | Version, operation: str, requirement_version: str
) -> bool:
    """Compare an installed library's version (or a version) with ``requirement_version``.

    Example::

        compare_versions("torch", ">=", "2.4")
        compare_versions(Version("1.2"), "<", "2")
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {list(_OPERATIONS)}, got {operation!r}")
    version = (
        parse(importlib.metadata.version(library_or_version))
        if isinstance(library_or_version, str)
        else library_or_version
    )
    return _OPERATIONS[operation](version, parse(requirement_version))


@functools.cache
def _torch_version() -> Version:
    return parse(importlib.metadata.version("torch"))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch with ``version``: ``is_torch_version(">=", "2.4")``."""
    return compare_versions(_torch_version(), operation, version)


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` this process has imported already."""
    return [name for name in library_names if name in sys.modules]


# -- packages -----------------------------------------------------------------------------
def _package_check(
    name: str,
    module: str,
    *distributions: str,
    min_version: str | None = None,
    below: str | None = None,
) -> Callable[[], bool]:
    """The check ``name``: whether ``module`` is installed (see :func:`is_package_available`)."""

    def check() -> bool:
        return is_package_available(module, *distributions, min_version=min_version, below=below)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"Whether ``{module}`` is installed" + (
        f" (version {min_version} or later)." if min_version else "."
    )
    return check


is_4bit_bnb_available = _package_check(
    "is_4bit_bnb_available", "bitsandbytes", min_version="0.39.0"
)
is_8bit_bnb_available = _package_check(
    "is_8bit_bnb_available", "bitsandbytes", min_version="0.37.2"
)
is_aim_available = _package_check("is_aim_available", "aim", below="4.0.0")
is_amdsmi_available = _package_check("is_amdsmi_available", "amdsmi")
is_boto3_available = _package_check("is_boto3_available", "boto3")
is_clearml_available = _package_check("is_clearml_available", "clearml")
is_comet_ml_available = _package_check("is_comet_ml_available", "comet_ml", "comet_ml", "comet-ml")
is_datasets_available = _package_check("is_datasets_available", "datasets")
is_deepspeed_available = _package_check("is_deepspeed_available", "deepspeed")
is_dvclive_available = _package_check("is_dvclive_available", "dvclive")
is_import_timer_available = _package_check("is_import_timer_available", "import_timer")
is_lomo_available = _package_check("is_lomo_available", "lomo_optim", "lomo_optim", "lomo-optim")
is_matplotlib_available = _package_check("is_matplotlib_available", "matplotlib")
is_megatron_lm_available = _package_check(
    "is_megatron_lm_available", "megatron", "megatron-core", min_version="0.8.0"
)
is_mlflow_available = _package_check("is_mlflow_available", "mlflow", "mlflow", "mlflow-skinny")
is_msamp_available = _package_check("is_msamp_available", "msamp", "ms-amp", "msamp")
is_pandas_available = _package_check("is_pandas_available", "pandas")
is_peft_available = _package_check("is_peft_available", "peft")
is_pynvml_available = _package_check("is_pynvml_available", "pynvml", "pynvml", "nvidia-ml-py")
is_pytest_available = _package_check("is_pytest_available", "pytest")
is_rich_available = _package_check("is_rich_available", "rich")
is_sagemaker_available = _package_check("is_sagemaker_available", "sagemaker")
is_schedulefree_available = _package_check("is_schedulefree_available", "schedulefree")
is_swanlab_available = _package_check("is_swanlab_available", "swanlab")
is_timm_available = _package_check("is_timm_available", "timm")
is_torchao_available = _package_check("is_torchao_available", "torchao", min_version="0.6.1")
is_torchdata_available = _package_check("is_torchdata_available", "torchdata")
is_torchdata_stateful_dataloader_available = _package_check(
    "is_torchdata_stateful_dataloader_available", "torchdata", min_version="0.8.0"
)
is_torchvision_available = _package_check("is_torchvision_available", "torchvision")
is_trackio_available = _package_check("is_trackio_available", "trackio")
is_transformer_engine_available = _package_check(
    "is_transformer_engine_available",
    "transformer_engine",
    "transformer-engine",
    "transformer_engine",
)
is_transformers_available = _package_check("is_transformers_available", "transformers")
is_triton_available = _package_check("is_triton_available", "triton", "triton", "pytorch-triton")
is_wandb_available = _package_check("is_wandb_available", "wandb")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed (at ``min_version`` or later)."""
    return is_package_available("bitsandbytes", min_version=min_version)


def is_tensorboard_available() -> bool:
    """Whether tensorboard (or tensorboardX) is installed."""
    return is_package_available("tensorboard") or is_package_available("tensorboardX")


def is_pippy_available() -> bool:
    """Whether torch has pipeline parallelism (``torch.distributed.pipelining``)."""
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    """Whether ``torch.load(weights_only=True)`` takes an allow-list (torch 2.4 or later)."""
    return is_torch_version(">=", "2.4.0")


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is usable, asked through NVML so CUDA stays uninitialised."""
    import torch

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return bool(torch.cuda.is_available())


def is_rocm_available() -> bool:
    """Whether torch is a ROCm build with a usable AMD GPU."""
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's Metal (MPS) device is built and usable."""
    import torch

    return (
        is_torch_version(">=", min_version)
        and torch.backends.mps.is_available()
        and torch.backends.mps.is_built()
    )


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend."""
    import torch.distributed as dist

    check = getattr(dist.distributed_c10d, "is_xccl_available", None)
    return bool(check()) if check is not None else False


def _torch_device_available(extension: str | None, attribute: str, check_device: bool) -> bool:
    """Whether ``torch.<attribute>`` (added by importing ``extension``) has a device."""
    if extension is not None:
        if importlib.util.find_spec(extension.split(".")[0]) is None:
            return False
        try:
            importlib.import_module(extension)
        except Exception:  # a device extension can fail to import on a machine without one
            return False
    import torch

    backend = getattr(torch, attribute, None)
    if backend is None:
        return False
    try:
        if check_device:
            backend.device_count()
        return bool(backend.is_available())
    except RuntimeError:
        return False


@functools.cache
def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel GPU is usable through stock torch."""
    return _torch_device_available(None, "xpu", check_device)


@functools.cache
def is_npu_available(check_device: bool = False) -> bool:
    """Whether an Ascend NPU is usable (``torch_npu``)."""
    return _torch_device_available("torch_npu", "npu", check_device)


@functools.cache
def is_mlu_available(check_device: bool = False) -> bool:
    """Whether a Cambricon MLU is usable (``torch_mlu``)."""
    return _torch_device_available("torch_mlu", "mlu", check_device)


@functools.cache
def is_musa_available(check_device: bool = False) -> bool:
    """Whether a Moore Threads MUSA device is usable (``torch_musa``)."""
    return _torch_device_available("torch_musa", "musa", check_device)


@functools.cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether an SDAA device is usable (``torch_sdaa``)."""
    return _torch_device_available("torch_sdaa", "sdaa", check_device)


@functools.cache
def is_neuron_available(check_device: bool = False) -> bool:
    """Whether an AWS Neuron device is usable (``torch_neuronx``)."""
    return _torch_device_available("torch_neuronx", "neuron", check_device)


@functools.cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether an Intel Gaudi HPU is usable (``habana_frameworks.torch``)."""
    available = _torch_device_available("habana_frameworks.torch", "hpu", False)
    if available and init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return available


@functools.cache
def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (and, when asked, runs on a TPU or a GPU)."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be true")
    if not is_package_available("torch_xla", "torch_xla", "torch-xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    runtime: Any = importlib.import_module("torch_xla.runtime")
    kind = runtime.device_type()
    return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this machine computes in bfloat16 (every CPU does; GPUs since Ampere)."""
    import torch

    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    """Whether this machine computes in float16: always, on the devices slipstream runs on
    (Accelerate says no for first-generation Gaudi HPUs only)."""
    return True


def is_fp8_available() -> bool:
    """Whether an fp8 training library is installed (torchao, Transformer Engine or MS-AMP).

    slipstream's ``mixed_precision="fp8"`` uses torchao, on GPUs with fp8 support.
    """
    return is_torchao_available() or is_transformer_engine_available() or is_msamp_available()
