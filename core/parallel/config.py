"""ParallelismConfig: how the processes of a job are arranged into a device mesh.

The same names as Accelerate's ``ParallelismConfig`` (and the same config-file keys, with
the ``parallelism_config_`` prefix), plus ``pp_size`` for pipeline parallelism and the
tensor-parallel plan options. Sizes multiply to the world size; one size may be ``-1`` to
take what the others leave, and when neither data-parallel size is given ``dp_shard_size``
takes it (``ParallelismConfig(tp_size=2)`` on 8 processes is dp_shard 4 x tp 2).

Example::

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)          # 4 processes
    accelerator = Accelerator(parallelism_config=config)

The same as YAML::

    parallelism_config:
      parallelism_config_dp_shard_size: 2
      parallelism_config_tp_size: 2
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime.env import parallelism_environment
from .accelerate_view import AccelerateView
from .config_values import (
    CONFIG_KEYS,
    PIPELINE_BALANCE,
    UNSUPPORTED_ACCELERATE_KEYS,
    as_bool,
    as_size,
    plain_ep_plan,
    plain_tp_plan,
    schedule_name,
)
from .errors import ParallelismConfigError

#: Mesh dimensions, outermost first (torchtitan's order). Data-parallel dims are
#: ``dp_replicate`` and ``dp_shard``; processes that differ only in ``cp``, ``tp`` or ``pp``
#: see the same samples.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
CP_COMM_STRATEGIES = ("allgather", "alltoall")
CONFIG_PREFIX = "parallelism_config_"
#: Style names (transformers' spelling) -> which weight dimension they split, for checks.
#: "out" = the output features of a Linear (its weight's dim 0), "in" = its input features.
STYLE_SPLITS = {
    "colwise": "out",
    "colwise_gather_output": "out",
    "colwise_rep": "out",
    "rowwise": "in",
    "rowwise_split_input": "in",
    "rowwise_rep": "in",
    "embedding_rowwise": "rows",
    "embedding_colwise": "columns",
    "sequence_parallel": None,
    "replicate": None,
    # transformers' name for a replicated weight whose gradient is summed over the TP ranks
    # (Qwen3's per-head q_norm/k_norm, which see only this rank's heads).
    "replicated_with_grad_allreduce": None,
}


@dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel options (Accelerate's ``tp_handler``).

    Args:
        enable_async_tp: accepted for Accelerate compatibility; asynchronous TP needs
            ``torch.compile`` with symmetric memory on CUDA and is not used yet.
    """

    enable_async_tp: bool = False


@dataclass
class TorchContextParallelConfig:
    """Context-parallel options (Accelerate's ``cp_handler``).

    Args:
        cp_comm_strategy: how attention exchanges keys/values between the context-parallel
            ranks: ``"allgather"`` (default) or ``"alltoall"`` (ring rotation).
    """

    cp_comm_strategy: str = ""

    def __post_init__(self) -> None:
        source = ""
        if not self.cp_comm_strategy:  # not given: Accelerate's launcher variable, else allgather
            given = parallelism_environment().get("cp_comm_strategy")
            source = " (from PARALLELISM_CONFIG_CP_COMM_STRATEGY)" if given else ""
            self.cp_comm_strategy = given or "allgather"
        if self.cp_comm_strategy not in CP_COMM_STRATEGIES:
            raise ParallelismConfigError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}{source}; use one of "
                f"{', '.join(CP_COMM_STRATEGIES)}"
            )


@dataclass(frozen=True)
class MeshSizes:
    """Resolved sizes of every mesh dimension (all >= 1, product = world size)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    #: Expert parallelism: not a dimension of its own but a split of dp_shard x cp (it
    #: divides it): the experts are spread over ``ep`` of those processes.
    ep: int = 1

    def size(self, dim: str) -> int:
        return int(getattr(self, dim))

    @property
    def world_size(self) -> int:
        return math.prod(self.size(d) for d in MESH_DIMS)

    @property
    def data_parallel_size(self) -> int:
        """Processes that each see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def enabled(self) -> tuple[str, ...]:
        """The dimensions larger than one, outermost first."""
        return tuple(d for d in MESH_DIMS if self.size(d) > 1)

    def describe(self) -> str:
        parts = [f"{d}={self.size(d)}" for d in MESH_DIMS if self.size(d) > 1]
        experts = f" (experts over ep={self.ep})" if self.ep > 1 else ""
        return (" x ".join(parts) or "one process") + experts

    def beyond_data_parallel(self) -> list[str]:
        """The dimensions a data-parallel engine such as DeepSpeed ZeRO (which shards over
        every process itself) cannot work inside: tp, cp, pp, ep, or both dp dims (HSDP)."""
        model_parallel = [d for d in ("tp", "cp", "pp", "ep") if self.size(d) > 1]
        if model_parallel:
            return model_parallel
        return ["dp_replicate", "dp_shard"] if self.dp_replicate > 1 and self.dp_shard > 1 else []


TensorParallelPlan = Mapping[str, Any]
#: Module-name patterns of the experts modules (a list, or a mapping to ``"experts"``).
ExpertParallelPlan = Mapping[str, str] | Sequence[str]


@dataclass
class ParallelismConfig(AccelerateView):
    """How processes are arranged: data parallel (replicated and sharded), tensor, context
    and pipeline parallel.

    Args:
        dp_replicate_size: replicas that each hold the whole (sharded) model; with
            ``dp_shard_size > 1`` too this is HSDP.
        dp_shard_size: processes over which parameters, gradients and optimizer state are
            sharded (FSDP2).
        tp_size: processes that split each layer's weights (tensor parallelism).
        cp_size: processes that split each sequence (context parallelism; CUDA only).
        pp_size: pipeline stages (reserved for pipeline parallelism).
        tp_plan: module-name patterns (``*`` matches one name part) mapped to
            ``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``, ``"rowwise_split_input"``,
            ``"embedding_rowwise"``, ``"embedding_colwise"``, ``"sequence_parallel"``,
            ``"replicate"`` or a DTensor ``ParallelStyle``; or a function of the model that
            returns such a mapping. ``None`` uses a transformers model's own plan.
        sequence_parallel: also shard activations along the sequence between TP regions
            (norms and dropout listed as ``"sequence_parallel"`` in the plan run on a slice
            of the sequence).
        sequence_dim: the sequence dimension of activations for ``sequence_parallel``.
        pp_schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``,
            ``"looped_bfs"``, ``"interleaved_zb"``, ``"zbv"`` or ``"dualpipev"`` (torch's
            schedules; the last five run several stages per process).
        pp_microbatches: micro-batches each batch is split into (default: the number of
            stages); the per-process batch size must be a multiple of it.
        pp_stages_per_rank: stages per process for interleaved schedules (default 2).
        pp_split_points: module names where a stage starts (e.g. ``["layers.4"]``),
            instead of balancing the blocks.
        pp_balance: ``"parameters"`` (default: equal parameter counts per stage) or
            ``"count"`` (equal numbers of blocks).
        cp_backend: ``"torch"`` (the only one; accepted for Accelerate compatibility).
        tp_handler: Accelerate's tensor-parallel options (:class:`TorchTensorParallelConfig`).
        cp_handler: Accelerate's context-parallel options (:class:`TorchContextParallelConfig`).
        ep_size: processes that split the experts of a mixture-of-experts model (expert
            parallelism). Not a mesh dimension of its own: it divides ``dp_shard_size x
            cp_size``; each process keeps ``num_experts / ep_size`` experts, tokens travel to
            their experts with ``all_to_all``. See docs/moe.md.
        ep_plan: module-name patterns of the experts modules (a list, or a mapping to
            ``"experts"``; transformers' ``"ep_dispatch_experts"`` spelling is accepted), or a
            function of the model that returns one. ``None`` uses a transformers model's own
            ``base_model_ep_plan``.

    A size left unset is read from Accelerate's launcher variables
    (``PARALLELISM_CONFIG_TP_SIZE``, ... set by ``accelerate launch``) when they are set, else
    it is 1. If no size is given at all, every process is a data-parallel
    replica (like Accelerate); with only ``ep_size``, every process shards (FSDP2). One size
    may be ``-1``: it takes what the others leave. When only model-parallel sizes are given
    (neither ``dp_replicate_size`` nor ``dp_shard_size``), ``dp_shard_size`` takes what they
    leave: ``ParallelismConfig(pp_size=2)`` on 4 processes is 2 stages x dp_shard 2, where
    Accelerate would ask for ``dp_shard_size=2`` (or ``-1``) explicitly.

    Example::

        ParallelismConfig(dp_shard_size=4, ep_size=2)   # experts over 2 of the 4 shards
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    pp_size: int | None = None
    tp_plan: TensorParallelPlan | Callable[[Any], TensorParallelPlan | None] | None = None
    sequence_parallel: bool = False
    sequence_dim: int = 1
    cp_backend: str = "torch"
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    pp_split_points: list[str] | None = None
    pp_balance: str = "parameters"
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    ep_size: int | None = None
    ep_plan: ExpertParallelPlan | Callable[[Any], ExpertParallelPlan | None] | None = None
    #: Set by :meth:`resolve`: the sizes actually used.
    sizes: MeshSizes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._read_launcher_variables()
        given = self._given()
        auto = [name for name, size in given.items() if size == -1]
        if len(auto) > 1:
            raise ParallelismConfigError(
                f"only one parallel size may be -1 (take the rest of the processes); got -1 for "
                f"{', '.join(f'{n}_size' for n in auto)}"
            )
        for name, size in given.items():
            if size is not None and size != -1 and (not isinstance(size, int) or size < 1):
                raise ParallelismConfigError(
                    f"{name}_size must be a positive integer (or -1 for the rest), got {size!r}"
                )
        if self.ep_size is not None and (not isinstance(self.ep_size, int) or self.ep_size < 1):
            raise ParallelismConfigError(
                f"ep_size must be a positive integer, got {self.ep_size!r}"
            )
        if self.cp_backend != "torch":
            raise ParallelismConfigError(
                f"cp_backend must be 'torch' (torch's context-parallel attention), got "
                f"{self.cp_backend!r}"
            )
        if self.pp_microbatches is not None and (
            not isinstance(self.pp_microbatches, int) or self.pp_microbatches < 1
        ):
            raise ParallelismConfigError(
                f"pp_microbatches must be a positive integer, got {self.pp_microbatches!r}"
            )
        self.pp_schedule = schedule_name(self.pp_schedule)
        if self.pp_balance not in PIPELINE_BALANCE:
            raise ParallelismConfigError(
                f"pp_balance must be one of {', '.join(PIPELINE_BALANCE)}, got {self.pp_balance!r}"
            )
        if isinstance(self.pp_split_points, str):
            self.pp_split_points = [p.strip() for p in self.pp_split_points.split(",") if p]
        if self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()

    def _given(self) -> dict[str, int | None]:
        return {
            "pp": self.pp_size,
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "cp": self.cp_size,
            "tp": self.tp_size,
        }

    # -- resolution ---------------------------------------------------------------------
    def resolve(self, world_size: int) -> MeshSizes:
        """The sizes for ``world_size`` processes; raises when they cannot fit it.

        Example::

            ParallelismConfig(tp_size=2).resolve(8)   # MeshSizes(dp_shard=4, tp=2)
        """
        given = self._given()
        implied = False
        model_sizes = [given[dim] for dim in ("pp", "cp", "tp") if given[dim] is not None]
        if given["dp_replicate"] is None and given["dp_shard"] is None:
            if all(size == 1 for size in model_sizes):
                # Nothing beyond data parallelism: every process a replica (Accelerate's
                # rule); experts are split over shards, so with ep_size every process shards.
                given["dp_shard" if self._size("ep") > 1 else "dp_replicate"] = world_size
            elif -1 not in model_sizes:
                # Model-parallel sizes only: the processes they leave shard the model (FSDP2),
                # as tp/cp/pp combine with dp_shard, not with plain replicas.
                given["dp_shard"], implied = -1, True
        sizes = {name: (1 if size is None else size) for name, size in given.items()}
        auto = [name for name, size in sizes.items() if size == -1]
        fixed_sizes = {name: size for name, size in sizes.items() if size != -1}
        fixed = math.prod(fixed_sizes.values())
        if auto:
            if world_size % fixed and implied:
                raise ParallelismConfigError(
                    f"{_equals(fixed_sizes)} does not fit the job: dp_shard_size (not given) "
                    "takes the processes the other sizes leave, which needs their product to "
                    f"divide the number of processes, but the job has {world_size} process(es); "
                    f"choose sizes whose product divides {world_size}"
                )
            if world_size % fixed:
                raise ParallelismConfigError(
                    f"{auto[0]}_size=-1 takes the processes the other sizes leave, but "
                    f"{_equals(fixed_sizes)} does not divide the {world_size} processes; "
                    "choose sizes whose product divides the number of processes"
                )
            sizes[auto[0]] = world_size // fixed
        elif fixed != world_size:
            raise ParallelismConfigError(
                f"the parallel sizes multiply to {_product(sizes)} = {fixed} but the job has "
                f"{world_size} process(es); make dp_replicate_size x dp_shard_size x cp_size x "
                f"tp_size x pp_size equal {world_size} (or set one of them to -1, or leave "
                "both data-parallel sizes out: dp_shard_size then takes the rest)"
            )
        ep = self._size("ep")
        shards = sizes["dp_shard"] * sizes["cp"]
        if shards % ep:
            raise ParallelismConfigError(
                f"ep_size={ep} does not divide dp_shard_size x cp_size = {shards}: expert "
                "parallelism spreads the experts over processes that shard the rest of the "
                f"model; choose an ep_size that divides {shards} (or a larger dp_shard_size)"
            )
        if ep > 1 and self.sequence_parallel and sizes["tp"] > 1:
            raise ParallelismConfigError(
                "ep_size > 1 with sequence_parallel=True is not supported: between the "
                "tensor-parallel regions each TP process would route other tokens to the same "
                "experts; use plain tensor parallelism (sequence_parallel=False) with experts"
            )
        resolved = MeshSizes(**sizes, ep=ep)
        self.sizes = resolved
        return resolved

    # -- config files -------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """The ``parallelism_config:`` block (sizes and plain options only)."""
        block: dict[str, Any] = {}
        for dim in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"):
            value = getattr(self, f"{dim}_size")
            if value is not None:
                block[f"{CONFIG_PREFIX}{dim}_size"] = value
        if self.sequence_parallel:
            block[f"{CONFIG_PREFIX}sequence_parallel"] = True
        defaults = {"pp_schedule": "1f1b", "pp_balance": "parameters"}
        for key in ("pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_balance"):
            value = getattr(self, key)
            if value is not None and value != defaults.get(key):
                block[f"{CONFIG_PREFIX}{key}"] = value
        if self.pp_split_points:
            block[f"{CONFIG_PREFIX}pp_split_points"] = list(self.pp_split_points)
        if isinstance(self.tp_plan, Mapping) and all(
            isinstance(v, str) for v in self.tp_plan.values()
        ):
            block[f"{CONFIG_PREFIX}tp_plan"] = dict(self.tp_plan)
        if self.ep_plan is not None and not callable(self.ep_plan):
            block[f"{CONFIG_PREFIX}ep_plan"] = plain_ep_plan(self.ep_plan)
        assert self.cp_handler is not None
        if self.cp_handler.cp_comm_strategy != "allgather":
            block[f"{CONFIG_PREFIX}cp_comm_strategy"] = self.cp_handler.cp_comm_strategy
        return block

    @classmethod
    def from_config(cls, block: Mapping[str, Any]) -> ParallelismConfig:
        """Build from a ``parallelism_config`` block (keys with or without the prefix)."""
        values: dict[str, Any] = {}
        comm_strategy: str | None = None
        for raw_key, value in block.items():
            key = str(raw_key).removeprefix(CONFIG_PREFIX)
            if key in UNSUPPORTED_ACCELERATE_KEYS:
                if value not in UNSUPPORTED_ACCELERATE_KEYS[key]:
                    raise ParallelismConfigError(
                        f"parallelism_config: {raw_key}={value!r} asks for DeepSpeed sequence "
                        "parallelism (Ulysses), which slipstream does not provide; use "
                        "parallelism_config_cp_size for long sequences"
                    )
                continue
            if key not in CONFIG_KEYS:
                spelled = [CONFIG_PREFIX + k for k in CONFIG_KEYS]
                close = difflib.get_close_matches(CONFIG_PREFIX + key, spelled, 1, cutoff=0.8)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ParallelismConfigError(f"parallelism_config: unknown key '{raw_key}'{hint}")
            if key.endswith("_size"):
                values[key] = as_size(raw_key, value)
            elif key == "sequence_parallel":
                values[key] = as_bool(raw_key, value)
            elif key == "sequence_dim":
                values[key] = as_size(raw_key, value)
            elif key == "tp_plan":
                values[key] = plain_tp_plan(value, raw_key)
                _check_style_names(raw_key, values[key])
            elif key == "ep_plan":
                values[key] = plain_ep_plan(value, raw_key)
            elif key == "cp_comm_strategy":
                comm_strategy = str(value)
            elif key in ("pp_microbatches", "pp_stages_per_rank"):
                values[key] = None if value in (None, "") else as_size(raw_key, value)
            elif key == "pp_split_points":
                values[key] = (
                    [p.strip() for p in value.split(",") if p.strip()]
                    if isinstance(value, str)
                    else [str(p) for p in value or []]
                )
            else:
                values[key] = value
        config = cls(**values)
        if comm_strategy is not None:
            config.cp_handler = TorchContextParallelConfig(cp_comm_strategy=comm_strategy)
        return config


def _check_style_names(key: str, plan: Mapping[str, str]) -> None:
    """Style names in a config block are checked when it is read, so a typo stops the
    launcher instead of every worker."""
    for pattern, style in plan.items():
        if style not in STYLE_SPLITS:
            close = difflib.get_close_matches(style, list(STYLE_SPLITS), 1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ParallelismConfigError(
                f"parallelism_config: {key}: '{pattern}' has unknown style {style!r}{hint}; use "
                f"one of {', '.join(STYLE_SPLITS)}"
            )


def _product(sizes: Mapping[str, int]) -> str:
    shown = [f"{name}_size={size}" for name, size in sizes.items() if size != 1]
    return " x ".join(shown) or "1"


def _equals(sizes: Mapping[str, int]) -> str:
    """``tp_size=3`` or ``pp_size=2 x tp_size=3 = 6``."""
    shown = _product(sizes)
    return f"{shown} = {math.prod(sizes.values())}" if " x " in shown else shown
