"""SlipstreamStrategy: Lightning's Trainer on slipstream's DDP, FSDP2, DeepSpeed and N-D
(tensor-parallel inside FSDP2/HSDP) parallelism.

The strategy is an adapter. The process group comes from
:meth:`slipstream.runtime.state.ProcessState.from_environment`; wrapping, backward, ``no_sync``,
clipping, state dicts and checkpoint layouts come from the same core strategy objects the
Accelerator uses (:func:`slipstream.strategies.get_strategy_class`); collectives are
:mod:`slipstream.runtime.collectives`. Nothing here implements a parallelism of its own: a parallel
layout is arranged by :func:`slipstream.parallel.mesh.configure_parallelism` and applied
by the core ``model_parallel`` strategy, as with the Accelerator.

Example::

    import lightning.pytorch as pl
    import slipstream.integrations.lightning  # registers "slipstream", "slipstream_fsdp", ...

    trainer = pl.Trainer(strategy="slipstream", accelerator="cpu", devices=2)
    trainer = pl.Trainer(strategy=SlipstreamStrategy(kind="fsdp", config="fsdp.yaml"))
    layout = ParallelismConfig(dp_shard_size=2, tp_size=2,
                               tp_plan={"mlp.up": "colwise", "mlp.down": "rowwise"})
    trainer = pl.Trainer(strategy=SlipstreamStrategy(parallelism_config=layout), devices=4)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn.parallel import DistributedDataParallel

from slipstream.optim.step import StepState
from slipstream.parallel import ParallelismConfig, ParallelismConfigError
from slipstream.runtime import collectives
from slipstream.runtime.env import mark_as_spawner
from slipstream.runtime.state import ProcessState
from slipstream.strategies import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    Strategy,
    get_strategy_class,
)

from .checkpointing import CheckpointingMixin
from .communication import CollectivesMixin
from .metrics import EvaluationPasses, attach_exact_metrics
from .options import ConfigInput, resolve_options
from .precision import SlipstreamPrecision, is_default_plugin, to_slipstream_precision
from .process_group import ProcessGroupMixin

try:  # Lightning's glue for manual optimization under DDP (private, present in 2.x)
    from lightning.pytorch.overrides.distributed import prepare_for_backward
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
except ImportError:  # pragma: no cover - other Lightning versions
    prepare_for_backward = None
    _DDPForwardRedirection = None


class SlipstreamStrategy(ProcessGroupMixin, CheckpointingMixin, CollectivesMixin, ParallelStrategy):
    """A Lightning ``ParallelStrategy`` running on slipstream's core.

    Args:
        kind: ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or ``"model_parallel"``; by default what
            ``config`` or ``slipstream launch`` says (``distributed_type``, a
            ``parallelism_config`` block), else DDP.
        config: a slipstream/Accelerate config file, a dict of its keys, or a
            :class:`~slipstream.launcher.config.LaunchConfig` (``distributed_type``,
            ``mixed_precision``, ``fsdp_config``, ``deepspeed_config``,
            ``parallelism_config``).
        parallelism_config: arrange the processes in a device mesh
            (:class:`~slipstream.ParallelismConfig`: data-parallel replicate/shard and tensor
            parallel sizes, the tensor-parallel plan); implies ``kind="model_parallel"``.
            Samplers, ``self.log(..., sync_dist=True)``, ``all_gather`` and torchmetrics then
            work over the data-parallel processes: a tensor-parallel group reads one share of
            the data. ``fsdp_plugin`` / ``fsdp_options`` set the FSDP2 part; checkpoints are
            sharded (torch.distributed.checkpoint) unless they say otherwise.
        precision: the precision when the Trainer sets none (``"bf16-mixed"``, ``"16-mixed"``
            for fp16 with a loss scaler also on CPU, ...). A different precision on the
            Trainer as well is an error.
        fsdp_plugin / deepspeed_plugin: full plugin objects (override the config blocks).
        fsdp_options / deepspeed_options: single keys over the config blocks, e.g.
            ``{"state_dict_type": "SHARDED_STATE_DICT"}`` or ``{"zero_stage": 3}``.
        weights_dtype: cast the floating weights of saved checkpoints (e.g. torch.bfloat16);
            sharded checkpoints get consolidated ``model.safetensors`` in this dtype.
        process_group_backend, timeout: for the process group slipstream creates.
        start_method: ``"popen"`` (Lightning re-runs the script per process) or
            ``"spawn"``/``"fork"``.
        **ddp_kwargs: options of ``DistributedDataParallel`` (kind ``"ddp"`` only).

    Example::

        trainer = Trainer(strategy=SlipstreamStrategy(kind="deepspeed",
                                                      deepspeed_options={"zero_stage": 3}),
                          accelerator="cpu", devices=2, precision="bf16-mixed")
    """

    strategy_name = "slipstream"

    def __init__(
        self,
        kind: str | None = None,
        config: ConfigInput = None,
        *,
        parallelism_config: ParallelismConfig | None = None,
        precision: str | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        fsdp_options: Mapping[str, Any] | None = None,
        deepspeed_options: Mapping[str, Any] | None = None,
        weights_dtype: torch.dtype | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: str = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: LightningPrecision | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        self.options = resolve_options(
            kind, config, fsdp_options, deepspeed_options, parallelism_config
        )
        self.kind = self.options.kind
        #: The process layout (kind "model_parallel" only).
        self.parallelism: ParallelismConfig | None = self.options.parallelism
        if ddp_kwargs and self.kind != "ddp":
            raise ValueError(
                f"{', '.join(sorted(ddp_kwargs))} are DistributedDataParallel options, but this "
                f"SlipstreamStrategy uses {self.kind}; drop them or use kind='ddp'"
            )
        if fsdp_plugin is not None and not self._shards_in_place:
            raise ValueError(
                f"fsdp_plugin given but the kind is {self.kind!r}; use kind='fsdp' or "
                "kind='model_parallel'"
            )
        if deepspeed_plugin is not None and self.kind != "deepspeed":
            raise ValueError(
                f"deepspeed_plugin given but the kind is {self.kind!r}; use kind='deepspeed'"
            )
        self._ddp_kwargs = ddp_kwargs
        if self.kind == "model_parallel":
            # None: the core strategy's own defaults (sharded checkpoints), as the Accelerator.
            self._fsdp_plugin = fsdp_plugin or self.options.model_parallel_plugin()
        else:
            self._fsdp_plugin = fsdp_plugin or (
                self.options.fsdp_plugin() if self.kind == "fsdp" else None
            )
        self._deepspeed_plugin = deepspeed_plugin or (
            self.options.deepspeed_plugin() if self.kind == "deepspeed" else None
        )
        if precision is not None and precision_plugin is not None:
            raise ValueError("pass precision or precision_plugin to SlipstreamStrategy, not both")
        # Kept apart from Lightning's slot until the Trainer's connector assigns its plugin,
        # so a conflict between the two is reported by the setter below, clearly.
        explicit = precision if precision is not None else precision_plugin
        self._requested_precision = (
            to_slipstream_precision(explicit) if explicit is not None else None
        )
        self.weights_dtype = weights_dtype
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be popen, spawn, fork or forkserver, got {start_method!r}"
            )
        self._start_method = start_method
        self._num_nodes = 1
        self.state: ProcessState | None = None
        self.core: Strategy | None = None
        self.step_state = StepState()
        self.passes = EvaluationPasses()
        self._reader: Any = None  # open sharded checkpoint between load and restore
        if self.kind == "ddp" and _DDPForwardRedirection is not None:
            # Manual optimization: DDP's reducer is prepared in pre_backward, not in forward.
            self._forward_redirection = _DDPForwardRedirection()

    @property
    def _shards_in_place(self) -> bool:
        """FSDP2 (alone or under a mesh) shards the LightningModule itself, no wrapper."""
        return self.kind in ("fsdp", "model_parallel")

    # -- Lightning's bookkeeping (as DDPStrategy) ------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Lets Lightning inject a DistributedSampler into the dataloaders."""
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.kind != "model_parallel":
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        state = self.state
        if state is None or state.mesh is None:
            raise RuntimeError(
                "SlipstreamStrategy(kind='model_parallel') shards data over the data-parallel "
                "processes of its device mesh, which exists once the Trainer has set up the "
                "process group; create samplers inside trainer.fit/validate/test/predict"
            )
        # The processes of one tensor-parallel group read the same samples: the data is split
        # over the data-parallel coordinates only.
        return {"num_replicas": state.data_parallel_size, "rank": state.data_parallel_index}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Both copies of the flag, as Lightning's DDPStrategy: rank-zero-only logging.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check_layout()
        if (
            self.num_processes * self.num_nodes == 1
            and not self.cluster_environment.creates_processes_externally
        ):
            # One process: nothing to start (and no launcher variables written into
            # the process environment, so notebooks and test sessions stay clean).
            self._launcher = None
        elif self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                mark_as_spawner()  # the script copies it starts end if this process dies
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _check_layout(self) -> None:
        """Fail when the Trainer is built, before any process starts, if the parallel sizes
        cannot multiply to the Trainer's number of processes."""
        if self.parallelism is None:
            return
        world = self.num_nodes * self.num_processes
        try:
            self.parallelism.resolve(world)
        except ParallelismConfigError as error:
            raise ParallelismConfigError(
                f"{error}. This Trainer runs devices={self.num_processes} x "
                f"num_nodes={self.num_nodes} = {world} process(es): change the sizes or the "
                "Trainer's devices/num_nodes"
            ) from None

    # -- precision --------------------------------------------------------------------------------
    @property  # type: ignore[override]
    def precision_plugin(self) -> SlipstreamPrecision:
        plugin = self._precision_plugin
        if isinstance(plugin, SlipstreamPrecision):
            return plugin
        return self._requested_precision or SlipstreamPrecision(
            self.options.mixed_precision or "32-true"
        )

    @precision_plugin.setter
    def precision_plugin(self, plugin: LightningPrecision | None) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        requested = getattr(self, "_requested_precision", None)
        if plugin is requested:
            self._precision_plugin = plugin
            return
        if is_default_plugin(plugin):
            # The Trainer asked for nothing (or "32-true"): the strategy's own choice, its
            # config or the launcher's mixed_precision decides.
            options = getattr(self, "options", None)
            default = options.mixed_precision if options is not None else None
            self._precision_plugin = requested or SlipstreamPrecision(default or "32-true")
            return
        converted = to_slipstream_precision(plugin)
        if requested is not None and requested.mode != converted.mode:
            raise ValueError(
                f"precision is set twice: SlipstreamStrategy(precision={requested.precision!r}) "
                f"and the Trainer (precision={converted.precision!r} or a precision plugin in "
                "plugins=[...]); set it in one place"
            )
        self._precision_plugin = converted

    # -- the core strategy ------------------------------------------------------------------------
    def _core_options(self, trainer: Any) -> dict[str, Any]:
        mode = self.precision_plugin.mode
        if self.kind == "ddp":
            return dict(self._ddp_kwargs)
        if mode.endswith("-true") or mode == "fp8":
            raise ValueError(
                f"precision {self.precision_plugin.precision!r} is not available with "
                f"{self.kind}; use 'bf16-mixed' or '16-mixed' (the weights are then cast by "
                f"{'FSDP' if self._shards_in_place else 'DeepSpeed'})"
            )
        if self.kind == "fsdp":
            return {"plugin": self._fsdp_plugin, "mixed_precision": mode}
        if self.kind == "model_parallel":
            return {
                "parallelism": self.parallelism,
                "plugin": self._fsdp_plugin,
                "mixed_precision": mode,
            }
        plugin = self._deepspeed_plugin
        assert plugin is not None
        clip = getattr(trainer, "gradient_clip_val", None)
        if clip and str(getattr(trainer, "gradient_clip_algorithm", "norm")) == "value":
            raise ValueError(
                "DeepSpeed clips gradients by norm only; use gradient_clip_algorithm='norm'"
            )
        # The Trainer's clipping becomes the engine's; consolidated weights are allowed so
        # full_state_dict() and weights_dtype can gather them on request (nothing else does).
        changes: dict[str, Any] = {"zero3_save_16bit_model": True}
        if clip:
            changes["gradient_clipping"] = float(clip)
        return {
            "plugin": dataclasses.replace(plugin, **changes),
            "mixed_precision": mode,
            "gradient_accumulation_steps": int(getattr(trainer, "accumulate_grad_batches", 1)),
        }

    def _build_core(self, trainer: Any) -> Strategy:
        assert self.state is not None, "setup_environment() runs before setup()"
        if self.core is not None and self.kind != "deepspeed":
            return self.core  # FSDP keeps its sharded models between fit/validate/test
        if self.core is not None:
            self.core.teardown()  # a DeepSpeed engine per stage, as Lightning's own
        core = get_strategy_class(self.kind)(self.state, **self._core_options(trainer))
        core.step_state = self.step_state
        self.core = core
        return core

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        core = self._build_core(trainer)
        assert self.state is not None and self.lightning_module is not None
        plugin = self.precision_plugin
        plugin.bind(core, self.root_device)
        module = self.lightning_module
        plugin.convert_module(module)
        if fitting:
            self.setup_optimizers(trainer)
        optimizers = list(self.optimizers) if fitting else []
        if self.kind == "ddp" and not fitting:
            # Nothing to synchronise outside fit: place the model and make all copies equal.
            module.to(self.root_device)
            collectives.broadcast(list(module.state_dict().values()), state=self.state)
            self.model = module
        elif self._shards_in_place and any(module is m for m in core.prepared_models):
            _, optimizers = core.setup([], optimizers, device_placement=[])  # already sharded
            self.model = module
        else:
            wrapped, optimizers = core.setup([module], optimizers, device_placement=[True])
            self.model = wrapped[0]
        if fitting:
            self.optimizers = optimizers
        self.setup_precision_plugin()
        # Metrics sync over the data-parallel processes: tensor-parallel peers saw the same
        # samples, and counting them once is what keeps the values exact.
        attach_exact_metrics(module, self.state.data_parallel, self.passes)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _require_core(self) -> Strategy:
        if self.core is None:
            raise RuntimeError("SlipstreamStrategy is not set up yet (call trainer.fit/validate)")
        return self.core

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module, model = self.lightning_module, self.model
        assert module is not None and model is not None
        with context():
            if model is not module or self._shards_in_place:
                # Through the wrapper's forward: DDP prepares its reducer, the DeepSpeed engine
                # and FSDP's root unit gather parameters, even when the step calls submodules
                # directly (FSDP shards the LightningModule in place, so Lightning would call
                # the step without passing through its forward hooks).
                return self._forward_redirection(model, module, name, *args, **kwargs)
            return getattr(module, name)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(
            "training_step", self.precision_plugin.train_step_context, *args, **kwargs
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(
            "validation_step", self.precision_plugin.val_step_context, *args, **kwargs
        )

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(
            "predict_step", self.precision_plugin.predict_step_context, *args, **kwargs
        )

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        module = self.lightning_module
        if (
            isinstance(self.model, DistributedDataParallel)
            and module is not None
            and not module.automatic_optimization
            and prepare_for_backward is not None
        ):
            prepare_for_backward(self.model, closure_loss)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: no gradient communication, no engine step."""
        core = self._require_core()
        assert self.model is not None
        self.step_state.sync_gradients = False
        try:
            with core.no_sync(self.model):
                yield None
        finally:
            self.step_state.sync_gradients = True

    # -- teardown ------------------------------------------------------------------------------------
    def teardown(self) -> None:
        module = self.lightning_module
        if self.kind == "ddp" and module is not None and self.model is not module:
            self.model = module  # unwrap DistributedDataParallel
        trainer = module._trainer if module is not None else None
        if self._layer_sync and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.revert(self.model)
        self._reader = None
        super().teardown()

    def __repr__(self) -> str:
        layout = ""
        sizes = self.parallelism.sizes if self.parallelism is not None else None
        if sizes is not None:
            layout = f", layout={sizes.describe()!r}"
        return (
            f"SlipstreamStrategy(kind={self.kind!r}, "
            f"precision={self.precision_plugin.precision!r}{layout})"
        )
