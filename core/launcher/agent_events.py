"""What torchrun's agent does to a job, one plain line each: workers lost (how, at which
step, which restart follows), a machine joining, the size after a rendezvous.

The agent itself logs these only at INFO, in its own words, among many other lines (which
``slipstream launch`` hides unless asked for). Inside :func:`agent_events` the agent's
methods that see them — its check on the workers, its restart and its rendezvous — also
announce them (:func:`slipstream.runtime.events.announce`), so the launcher prints them as
``slipstream launch: ...`` in order with the workers' own events. The step a lost process
was at comes from its flight file (:mod:`slipstream.runtime.flight_file`).

Example::

    with agent_events("replica group replica_1", folder):
        run(torchrun_namespace)
    # slipstream launch: replica group replica_1 lost (SIGKILL) at step 581; restart 1/3
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..runtime.events import announce
from ..runtime.flight_file import read_flight_files
from .failures import outcome_of, root_cause


def _how(outcome: Any) -> str:
    if outcome.signal_name is not None:
        return outcome.signal_name
    if outcome.error:
        kind = outcome.error.split(":", 1)[0]
        return f"lost its peers: {kind}" if outcome.caused_by_peer else kind
    return f"exit code {outcome.exitcode}"


def _steps(failures: dict[int, Any], folder: str | None) -> str:
    if not folder:
        return ""
    flights = read_flight_files(folder)
    steps = {
        flights[pid]["step"]
        for pid in (int(getattr(f, "pid", -1) or -1) for f in failures.values())
        if pid in flights
    }
    return f" at step {max(steps)}" if steps else ""


def _rendezvous_wait(handler: Any) -> str:
    """How long an elastic rendezvous takes to settle after a loss, from its settings."""
    settings = getattr(handler, "settings", None)
    if settings is None or not hasattr(settings, "keep_alive_interval"):
        return ""
    beat = settings.keep_alive_interval.total_seconds()
    attempts = settings.keep_alive_max_attempt
    last_call = settings.timeout.last_call.total_seconds()
    return (
        f"; a lost machine is dropped after {beat * attempts:.0f} s without heartbeats "
        f"(keep_alive_interval {beat:.0f} s x keep_alive_max_attempt {attempts}), and the "
        f"new size is settled {last_call:.0f} s (last_call_timeout) after the fewest "
        "machines are there"
    )


class _Announcer:
    """The agent's events of one launch (see the module docstring)."""

    def __init__(self, subject: str | None, folder: str | None, elastic: bool) -> None:
        self.subject = subject
        self.folder = folder
        self.elastic = elastic
        self.size: tuple[int, int] | None = None
        self.lost_at: float | None = None

    def checked(self, agent: Any, result: Any) -> None:
        state = getattr(result.state, "name", str(result.state))
        if state not in ("FAILED", "UNHEALTHY") or not result.failures:
            return
        failures = dict(result.failures)
        outcomes = [outcome_of(rank, failure) for rank, failure in sorted(failures.items())]
        root = root_cause(outcomes)
        spec = agent._worker_group.spec
        remaining = int(agent._remaining_restarts)
        if self.subject is None and spec.max_restarts == 0:
            return  # the job ends here: the launcher's failure summary says it once
        if self.subject is not None:
            what = f"{self.subject} lost ({_how(root)})"
        else:
            what = f"rank {root.rank} failed ({_how(root)})"
        what += _steps(failures, self.folder)
        if remaining > 0:
            restart = spec.max_restarts - remaining + 1
            follow = f"restart {restart}/{spec.max_restarts}"
            if self.elastic:
                follow += ": the workers meet again" + _rendezvous_wait(spec.rdzv_handler)
        else:
            follow = f"no restarts left (--max_restarts {spec.max_restarts})"
        self.lost_at = time.monotonic()
        announce(f"{what}; {follow}", self.folder)

    def restarting(self, agent: Any) -> None:
        state = getattr(agent._worker_group.state, "name", "")
        if state == "HEALTHY":  # not a failure: the rendezvous has machines waiting to join
            self.lost_at = time.monotonic()
            announce(
                "a machine asks to join: the workers stop and meet again at the larger size "
                "(no restart is used up)",
                self.folder,
            )

    def met(self, agent: Any) -> None:
        group = agent._worker_group
        workers = group.workers
        size = (int(group.group_world_size), int(workers[0].world_size) if workers else 0)
        before, self.size = self.size, size
        if before is None or before == size:
            return
        took = (
            f", {time.monotonic() - self.lost_at:.0f} s after the workers stopped"
            if self.lost_at
            else ""
        )
        announce(
            f"the job now runs on {size[0]} machine(s), {size[1]} process(es) (was "
            f"{before[0]}, {before[1]}){took}",
            self.folder,
        )


@contextlib.contextmanager
def agent_events(subject: str | None, folder: str | None, elastic: bool = False) -> Iterator[None]:
    """Announce the agent's events inside the block (see the module docstring); ``subject``
    names the group in the lines (``None``: the job's ranks)."""
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:  # pragma: no cover - torch without the elastic agent
        yield
        return
    announcer = _Announcer(subject, folder, elastic)
    monitor = LocalElasticAgent._monitor_workers
    restart = SimpleElasticAgent._restart_workers
    rendezvous = SimpleElasticAgent._rendezvous

    def monitored(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        with contextlib.suppress(Exception):  # a report must never break the agent
            announcer.checked(self, result)
        return result

    def restarted(self: Any, worker_group: Any) -> None:
        with contextlib.suppress(Exception):
            announcer.restarting(self)
        restart(self, worker_group)

    def met(self: Any, worker_group: Any) -> None:
        rendezvous(self, worker_group)
        with contextlib.suppress(Exception):
            announcer.met(self)

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    SimpleElasticAgent._restart_workers = restarted  # type: ignore[method-assign]
    SimpleElasticAgent._rendezvous = met  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        SimpleElasticAgent._restart_workers = restart  # type: ignore[method-assign]
        SimpleElasticAgent._rendezvous = rendezvous  # type: ignore[method-assign]
