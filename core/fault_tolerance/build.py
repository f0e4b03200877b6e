"""Building a replica group's fault-tolerance controller from the options and the
launcher's settings (refusing what cannot run fault tolerant)."""

from __future__ import annotations

from typing import Any

from ..options.errors import ConfigError
from ..options.fault_tolerance import FaultToleranceKwargs, unsupported_layout
from ..runtime.env import fault_tolerance_environment
from ..runtime.state import ProcessState
from .controller import FaultTolerance


def build_fault_tolerance(
    options: FaultToleranceKwargs | None,
    launch: dict[str, Any],
    state: ProcessState,
    layout: tuple[str, Any] = ("NO", None),
) -> FaultTolerance | None:
    """The controller for ``options`` (else the launcher's ``fault_tolerance_config``), or
    ``None`` when fault tolerance is off. ``layout``: the Accelerator's distributed type
    and ``ParallelismConfig`` (some cannot run fault tolerant)."""
    block = launch.get("fault_tolerance_config") or {}
    if options is None and block:
        options = FaultToleranceKwargs.from_config(dict(block))
    if options is None or not options.enabled:
        return None
    refused = unsupported_layout(layout[0], getattr(layout[1], "pp_size", None))
    if refused is not None:
        raise ConfigError(refused)
    environment = fault_tolerance_environment()
    lighthouse = options.lighthouse or environment["lighthouse"]
    replica_id = options.replica_id or environment["replica_id"]
    if not lighthouse:
        raise ConfigError(
            "fault tolerance needs a torchft lighthouse: pass FaultToleranceKwargs("
            "lighthouse='http://HOST:PORT'), or start the job with `slipstream launch "
            "--fault_tolerance` (which starts one and sets SLIPSTREAM_FT_LIGHTHOUSE)"
        )
    if not replica_id:
        raise ConfigError(
            "fault tolerance needs this replica group's name: pass FaultToleranceKwargs("
            "replica_id='replica_0') (a different index per group), or start the job with "
            "`slipstream launch --fault_tolerance`, which sets SLIPSTREAM_FT_REPLICA_ID"
        )
    if not replica_id[-1:].isdigit():
        raise ConfigError(
            f"FaultToleranceKwargs(replica_id={replica_id!r}): the name must end in the "
            "group's index (e.g. 'replica_0', 'replica_1'); torchft ranks groups by it"
        )
    groups = options.replica_groups or int(block.get("replica_groups") or 1)
    return FaultTolerance(
        options,
        state,
        lighthouse=lighthouse,
        replica_id=replica_id,
        groups=groups,
        finished_file=environment["finished_file"],
    )
