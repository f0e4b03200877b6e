"""What would make a plan fit when no layout does: the smallest peak and what it is made of,
then the changes that bring a layout under the device's memory (offload to host memory,
recomputation and a micro-batch of one are already among the layouts tried), and the
smallest number of nodes on which a layout fits.

Example::

    for line in what_would_fit(profile, cluster, 16, "bf16", closest, offloaded):
        print(line)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .hardware import Cluster
from .profile import ModelProfile

if TYPE_CHECKING:
    from .candidates import Candidate


def _gib(size: float) -> str:
    from .report import format_size

    return format_size(size)


def what_would_fit(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    closest: Sequence[Candidate],
    offloaded: Sequence[Candidate],
) -> list[str]:
    """Lines saying why nothing fits and what would."""
    limit = cluster.device.memory * cluster.device.usable
    lines = []
    if closest:
        best = closest[0]
        lines.append(
            f"no layout fits {_gib(limit)} per device: the smallest peak is "
            f"{_gib(best.memory.peak)} ({best.describe()}, micro-batch "
            f"{best.layout.micro_batch}): {best.memory.explain()}"
        )
        states = best.memory.part("parameters") + best.memory.part("optimizer states")
        if states > limit:
            lines.append(
                f"its parameters and optimizer states alone take {_gib(states)}: more devices "
                "(or offload) are needed, not a smaller batch"
            )
        elif best.layout.micro_batch > 1 or best.layout.recompute == "none":
            lines.append("a smaller micro-batch or full recomputation was tried and is not enough")
    if offloaded:
        first = offloaded[0]
        lines.append(
            f"offload fits: {first.describe()} peaks at {_gib(first.memory.peak)} per device and "
            f"keeps {_gib(first.memory.host)} per process in host memory (listed below)"
        )
    buckets = max((c.buckets for c in closest), default=0)
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = dataclasses.replace(cluster, nodes=cluster.nodes * factor)
        found = _fastest_fitting(profile, bigger, global_batch, precision, buckets)
        batch = global_batch
        if found is None:  # the batch cannot be split over so many: grow it with them
            batch = global_batch * factor
            found = _fastest_fitting(profile, bigger, batch, precision, buckets)
        if found is not None:
            lines.append(
                f"more devices: on {bigger.nodes} node(s) ({bigger.world_size} devices, global "
                f"batch {batch}) {found.describe()} fits at {_gib(found.memory.peak)}"
            )
            break
    else:
        lines.append(f"even {cluster.nodes * 64} nodes are not enough without offload")
    return lines


def _fastest_fitting(
    profile: ModelProfile, cluster: Cluster, batch: int, precision: str, buckets: int
) -> Candidate | None:
    from .candidates import enumerate_layouts, evaluate

    fits = [
        candidate
        for layout in enumerate_layouts(profile, cluster, batch, precision)
        if (candidate := evaluate(profile, layout, cluster, buckets)).fits
    ]
    return min(fits, key=lambda c: c.time.seconds) if fits else None
