"""PartialState: the process state without an Accelerator, for inference scripts.

It answers who this process is and runs code on some processes only, exactly as an
Accelerator does (both use :class:`~slipstream.runtime.process_control.ProcessControl`), without
preparing models, optimizers or loaders. Every ``PartialState()`` in a process — and an
Accelerator created later — shares one :class:`~slipstream.runtime.state.ProcessState`, so the
process group is joined once.

Example::

    state = PartialState()
    with state.split_between_processes(prompts) as mine:
        answers = [generate(p) for p in mine]
    everything = gather_object(answers)        # every process's answers, in prompt order
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from .process_control import ProcessControl
from .state import (
    DistributedType,
    current_state,
    has_current_state,
    join_or_build_state,
    reset_shared_state,
)


class SharedStateView(Mapping[str, Any]):
    """What Accelerate's ``_shared_state`` dict holds, read live: scripts compare it with
    ``{}`` to ask whether a state exists (``if PartialState._shared_state != {}``)."""

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read = read

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._read()))

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return f"SharedStateView({dict(self._read())!r})"


def _process_state_fields() -> Mapping[str, Any]:
    return vars(current_state()) if has_current_state() else {}


class PartialState(ProcessControl):
    """This process's place in the job: ``process_index``, ``num_processes``, ``device``,
    ``is_main_process``, ``split_between_processes``, ``main_process_first``,
    ``on_main_process``, ``wait_for_everyone``, ``print``...

    ``cpu=True`` runs on the CPU even where GPUs exist; ``backend`` and ``timeout`` apply
    when this call forms the process group.

    Example::

        state = PartialState()
        with state.main_process_first():
            dataset = load_dataset()          # downloads once, then the others read the cache
    """

    _shared_state: Mapping[str, Any] = SharedStateView(_process_state_fields)

    def __init__(
        self,
        cpu: bool = False,
        *,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        self.state = join_or_build_state(cpu, backend=backend, timeout=timeout)

    @property
    def initialized(self) -> bool:
        return has_current_state() and current_state() is self.state

    @property
    def default_device(self) -> torch.device:
        """The device this process runs on (the same as :attr:`device`)."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def backend(self) -> str | None:
        return self.state.backend

    @property
    def num_nodes(self) -> int:
        return max(1, self.state.num_processes // max(1, self.state.num_local_processes))

    @property
    def debug(self) -> bool:
        """Whether collectives first check that every process passes matching data (and
        raise :class:`~slipstream.runtime.errors.DistributedOperationException` otherwise);
        assignable, as in Accelerate (``PartialState().debug = True``)."""
        return self.state.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.state.debug = bool(value)

    def destroy_process_group(self) -> None:
        """Leave the process group (if this job formed it) and forget the shared state."""
        self.state.destroy_process_group()

    @staticmethod
    def _reset_state(reset_partial_state: bool = True) -> None:
        """Accelerate's reset between experiments: forget this process's state (the next
        PartialState or Accelerator builds a new one over the existing process group)."""
        reset_shared_state(reset_partial_state)

    def __repr__(self) -> str:
        return (
            f"PartialState(distributed_type={self.distributed_type.value}, num_processes="
            f"{self.num_processes}, process_index={self.process_index}, local_process_index="
            f"{self.local_process_index}, device={self.device})"
        )
