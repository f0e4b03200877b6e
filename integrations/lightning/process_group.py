"""How the Lightning strategy joins its job: the process group through the core
:class:`~slipstream.runtime.state.ProcessState` (or the one an earlier stage made), the job's
DeviceMesh for a parallel layout, and a watch on the process that started this one.

Mixed into :class:`~slipstream.integrations.lightning.SlipstreamStrategy`, before Lightning's
``ParallelStrategy`` (``setup_environment`` extends it).

Example::

    trainer = pl.Trainer(strategy="slipstream", devices=2)   # each process joins here
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed

from slipstream.parallel import ParallelismConfig
from slipstream.parallel.mesh import configure_parallelism
from slipstream.runtime.env import LaunchEnvironment, read_launch_environment
from slipstream.runtime.state import ProcessState, set_current_state


class ProcessGroupMixin:
    """The process-group half of the strategy (Lightning calls ``setup_environment``)."""

    state: ProcessState | None
    parallelism: ParallelismConfig | None
    cluster_environment: Any
    lightning_module: Any
    _process_group_backend: str | None
    _timeout: Any

    def setup_environment(self) -> None:
        super().setup_environment()
        self._watch_trainer_process()
        self.setup_distributed()

    def _watch_trainer_process(self) -> None:
        """A process the Trainer started (spawned, or a script copy) ends when the process
        that started it dies, instead of running on as an orphan."""
        import multiprocessing
        import os

        from slipstream.launcher.lifecycle import watch_parent
        from slipstream.runtime.env import spawner_pid

        spawned = multiprocessing.parent_process() is not None  # start_method spawn/fork
        copied = spawner_pid() is not None and spawner_pid() == os.getppid()  # popen
        if spawned or copied:
            watch_parent()

    def setup_distributed(self) -> None:
        """Join (or adopt) the process group through the core ProcessState."""
        reset_seed()
        self.set_world_ranks()
        if self.state is not None and (
            self.state.num_processes == 1 or torch.distributed.is_initialized()
        ):
            set_current_state(self.state)  # validate/test after fit: the same group
            self._configure_mesh()
            return
        environment = self.cluster_environment
        assert environment is not None
        outer = read_launch_environment()
        launch = LaunchEnvironment(
            rank=self.global_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=max(1, self.num_processes),
            master_addr=environment.main_address,
            master_port=environment.main_port,
            source="lightning",
            launch_config=outer.launch_config,
            debug=outer.debug,
            restart_count=outer.restart_count,
            agent_store=outer.agent_store,
        )
        state = ProcessState.from_environment(
            launch=launch,
            cpu=self.root_device.type != "cuda",
            backend=self._process_group_backend,
            timeout=self._timeout,
        )
        state.device = self.root_device  # Lightning's device choice (devices=[2, 3], ...)
        set_current_state(state)
        self.state = state
        self._configure_mesh()

    def _configure_mesh(self) -> None:
        """Build the job's DeviceMesh now (the core strategy later finds the same one), so
        the data-parallel coordinates exist for samplers and ``LightningModule.setup``, and
        ``self.device_mesh`` works in the LightningModule as with Lightning's own
        ModelParallelStrategy."""
        if self.parallelism is None:
            return
        assert self.state is not None
        mesh = configure_parallelism(self.state, self.parallelism)
        module = self.lightning_module
        if module is not None and hasattr(module, "_device_mesh"):
            module._device_mesh = mesh.mesh
