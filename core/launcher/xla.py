"""What ``slipstream launch --tpu`` checks before it starts XLA workers.

The workers themselves find the XLA device through torch_xla (see
:mod:`slipstream.runtime.xla`): the launcher only hands them ``distributed_type: XLA``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..options.errors import ConfigError

# ..runtime.xla imports torch: loaded only when a launch asks for XLA (`slipstream --help`
# and the launcher's own start stay without torch; benchmarks/startup.py).


def check_xla_launch(values: Mapping[str, Any], pod: bool) -> None:
    """``--tpu`` needs torch_xla here; TPU pods are started host by host."""
    if pod or values.get("tpu_use_cluster"):
        raise ConfigError(
            "tpu_use_cluster (--tpu_cluster): slipstream does not start TPU pods itself; run "
            "`slipstream launch --tpu ...` on every host of the pod (e.g. gcloud compute tpus "
            "tpu-vm ssh NAME --worker=all --command='...'), see docs/xla.md"
        )
    if str(values.get("distributed_type", "")).upper() != "XLA":
        return
    from ..runtime.xla import install_hint, xla_installed

    if not xla_installed():
        raise ConfigError(
            "distributed_type: XLA (--tpu) needs torch_xla, which is not installed: "
            f"{install_hint()}"
        )


def add_xla_options(group: Any, option: Callable[..., None]) -> None:
    """``--tpu`` (Accelerate's switch: ``distributed_type: XLA``) and ``--tpu_cluster``
    (accepted only to refuse it clearly); ``option`` adds a flag with both spellings."""
    option(
        group,
        "tpu",
        action="store_const",
        const=True,
        help="train on the XLA device through torch_xla (TPUs; PJRT_DEVICE picks the kind)",
    )
    option(
        group,
        "tpu_cluster",
        "--tpu_use_cluster",
        action="store_const",
        const=True,
        help="refused: start slipstream launch --tpu on every host of a TPU pod",
    )
