"""Checkpoint on preemption: a signal (SIGTERM from a cloud or Kubernetes, SIGUSR1 from
SLURM's ``--signal``) makes every process save a checkpoint at the next optimizer-step
boundary and exit with :data:`REQUEUE_EXIT_CODE`; the same command then resumes with
``accelerator.load_state("latest")``.

The signal may reach only some processes. The one that receives it writes the step at
which everyone stops into the job's key-value store (the one torch.distributed rendezvous
uses); every process looks there at each step boundary — one round trip to the store, no
collective and no barrier while nothing happens. Processes move through optimizer steps in
lockstep (each step's gradients are reduced together), so stopping one step after the
announcement reaches everyone in time.

Example::

    accelerator = Accelerator(project_dir="runs/a", save_on_preemption=True)
    ...
    accelerator.load_state("latest")      # resumes after a preemption, no-op on a fresh start
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .env import slurm_job_id

if TYPE_CHECKING:
    from .state import ProcessState

#: "Temporary failure, retry" (EX_TEMPFAIL): the job saved its state and should be requeued.
REQUEUE_EXIT_CODE = 75
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
_STORE_KEY = "slipstream/preemption/stop_at_step"


def signal_numbers(names: str | list[str] | tuple[str, ...]) -> list[int]:
    """``"SIGTERM,SIGUSR1"`` (names, with or without SIG, or numbers) -> signal numbers."""
    items = names.split(",") if isinstance(names, str) else list(names)
    numbers = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if item.isdecimal():
            numbers.append(int(item))
            continue
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(
                f"{item!r} is not a signal a process can handle; use names such as SIGTERM, "
                "SIGUSR1, SIGUSR2 or SIGINT"
            )
        numbers.append(int(number))
    return numbers


class PreemptionHandler:
    """Turns preemption signals into one agreed checkpoint-and-exit step for all processes."""

    def __init__(self, state: ProcessState, signals: str | list[str], requeue: bool = True):
        self.state = state
        self.signals = signal_numbers(signals)
        self.requeue = requeue
        self.received: int | None = None
        self.stop_at: int | None = None
        self._announced = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle the signals (in the main thread, where Python runs signal handlers)."""
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the checkpoint is written at the next step boundary, not in here.
        if self.received is None:
            self.received = signum

    # -- agreeing on the step -------------------------------------------------------------
    def _store(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.state.num_processes == 1:
            return None
        return dist.distributed_c10d._get_default_store()

    def should_stop(self, step: int) -> bool:
        """Called by every process at every optimizer-step boundary."""
        if self.stop_at is None:
            store = self._store()
            if self.received is not None and not self._announced:
                self._announced = True
                if store is None:
                    self.stop_at = step
                else:
                    # The first process to announce decides; the others keep its step.
                    agreed = store.compare_set(_STORE_KEY, "", str(step + 1))
                    self.stop_at = int(agreed)
            elif store is not None and store.check([_STORE_KEY]):
                self.stop_at = int(store.get(_STORE_KEY))
        return self.stop_at is not None and step >= self.stop_at

    # -- stopping -------------------------------------------------------------------------
    def stop(self, save: Callable[[], str], finish: Callable[[], None]) -> None:
        """Save (collective), request a SLURM requeue, and exit for requeue."""
        where = save()
        finish()
        name = signal.Signals(self.received).name if self.received else "another process"
        if self.state.is_main_process:
            print(
                f"slipstream: preempted ({name}); checkpoint saved to {where}; exiting with "
                f"{REQUEUE_EXIT_CODE} so the job is requeued and resumes from it",
                file=sys.stderr,
                flush=True,
            )
            if self.requeue:
                request_slurm_requeue()
        raise SystemExit(REQUEUE_EXIT_CODE)


def request_slurm_requeue() -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` when running under SLURM; whether it was asked."""
    job = slurm_job_id()
    if job is None:
        return False
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"slipstream: could not requeue SLURM job {job}: {error}", file=sys.stderr)
        return False
    return True
