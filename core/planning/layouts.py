"""A layout: how a job's processes split a model and its batch, and what each of them runs.

``world = dp_replicate x dp_shard x cp x tp x pp`` (expert parallelism splits dp_shard x cp,
as in :class:`~slipstream.ParallelismConfig`). The engine says how the data-parallel part
runs: ``ddp`` (every process holds everything), ``fsdp`` (FSDP2 over dp_shard x cp, HSDP
with dp_replicate; the only engine that combines with tp, pp, cp and ep), or ``zero1`` /
``zero2`` / ``zero3`` (DeepSpeed over every process). The batch: each data-parallel rank
runs ``micro_batch`` samples at a time, ``accumulation`` times per optimizer step (under a
pipeline the schedule runs ``pp_microbatches`` micro-batches instead).

A layout turns into what a script passes to slipstream::

    layout = Layout(dp_shard=2, tp=2, micro_batch=4)
    accelerator = Accelerator(**layout.accelerator_kwargs())
    ParallelismConfig(**layout.parallelism)          # the mesh part alone
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig

ENGINES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
#: ``full``: every block's activations are recomputed in backward (only its inputs kept).
#: ``selective``: torchtitan's op policy (every other matrix product's output and the
#: attention's kept) -- predicted for comparison with published runs; slipstream runs full.
RECOMPUTE = ("none", "full", "selective")
#: ``optimizer``: optimizer states (and the update) live on the host; ``all``: parameters
#: and gradients too (FSDP's CPU offload, ZeRO-3's offload_param).
OFFLOAD = ("none", "optimizer", "all")
MIXED_PRECISION = ("no", "bf16", "fp16")
_ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}


@dataclass(frozen=True)
class Layout:
    """One way to run a training step: sizes, engine, batch split, recomputation, offload."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    engine: str = "fsdp"
    micro_batch: int = 1
    accumulation: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_stages_per_rank: int = 1
    recompute: str = "none"
    offload: str = "none"
    mixed_precision: str = "bf16"

    def __post_init__(self) -> None:
        sizes = (self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp, self.ep)
        if min(sizes) < 1 or min(self.micro_batch, self.accumulation, self.pp_microbatches) < 1:
            raise ConfigError(f"layout sizes and batch counts must be at least 1: {self}")
        for value, allowed, what in (
            (self.engine, ENGINES, "engine"),
            (self.recompute, RECOMPUTE, "recompute"),
            (self.offload, OFFLOAD, "offload"),
            (self.mixed_precision, MIXED_PRECISION, "mixed_precision"),
        ):
            if value not in allowed:
                raise ConfigError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
        if self.shard_group % self.ep:
            raise ConfigError(f"ep {self.ep} must divide dp_shard x cp = {self.shard_group}")
        if self.engine != "fsdp" and self.model_parallel > 1:
            raise ConfigError(f"{self.engine} runs data parallelism only; use fsdp with tp/pp/cp")
        if self.engine == "ddp" and self.dp_shard > 1:
            raise ConfigError("ddp replicates: use dp_replicate for its processes")

    # -- sizes ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def model_parallel(self) -> int:
        """tp x pp x cp x (ep > 1): what goes beyond data parallelism."""
        return self.tp * self.pp * self.cp * (2 if self.ep > 1 else 1)

    @property
    def data_parallel(self) -> int:
        """Processes that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Processes over which the engine shards (ZeRO: every process)."""
        return self.dp_shard * self.cp

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of what the engine shards: 0 for DDP, 3 for FSDP."""
        return {"ddp": 0, "fsdp": 3}.get(self.engine) or _ZERO_STAGE[self.engine]

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank."""
        return self.pp_microbatches if self.pp > 1 else self.accumulation

    @property
    def samples_per_step(self) -> int:
        """The global batch this layout runs per optimizer step."""
        return self.data_parallel * self.micro_batch * self.microbatches

    # -- words ----------------------------------------------------------------------------
    @property
    def family(self) -> str:
        """E.g. ``FSDP``, ``HSDP``, ``DDP``, ``ZeRO-3``, ``TP+FSDP``, ``PP+TP``."""
        if self.engine == "ddp":
            return "DDP"
        if self.engine.startswith("zero"):
            return f"ZeRO-{self.zero_stage}"
        parts = [name for name, size in (("PP", self.pp), ("TP", self.tp), ("CP", self.cp),
                                         ("EP", self.ep)) if size > 1]  # fmt: skip
        if self.dp_replicate > 1 and self.shard_group > 1:
            parts.append("HSDP")
        elif self.shard_group > 1:
            parts.append("FSDP")
        elif self.dp_replicate > 1:
            parts.append("DP")
        return "+".join(parts) or "single"

    def describe(self) -> str:
        """The sizes in words, e.g. ``pp 2 (1f1b, 4 mb) x dp_shard 2``."""
        if self.engine == "ddp":
            sizes = [f"DDP {self.dp_replicate}"]
        elif self.engine.startswith("zero"):
            sizes = [f"ZeRO-{self.zero_stage} {self.dp_shard}"]
        else:
            sizes = []
            if self.pp > 1:
                stages = f", {self.pp_stages_per_rank} stages/rank" * (self.pp_stages_per_rank > 1)
                sizes.append(f"pp {self.pp} ({self.pp_schedule}{stages})")
            for name in ("dp_replicate", "dp_shard", "cp", "tp"):
                if getattr(self, name) > 1:
                    sizes.append(f"{name} {getattr(self, name)}")
            if self.ep > 1:
                sizes.append(f"ep {self.ep}")
            sizes = sizes or ["1 process"]
        extras = []
        if self.recompute != "none":
            extras.append(f"recompute {self.recompute}")
        if self.offload != "none":
            extras.append(f"offload {self.offload}")
        return " x ".join(sizes) + "".join(f", {extra}" for extra in extras)

    def describe_batch(self) -> str:
        """E.g. ``mb 2 x 4`` (micro-batch size x micro-batches per step)."""
        return f"{self.micro_batch} x {self.microbatches}"

    # -- what slipstream takes --------------------------------------------------------------
    @property
    def parallelism(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~slipstream.ParallelismConfig` for this layout's mesh
        (empty for DDP and DeepSpeed, which take no mesh)."""
        if self.engine != "fsdp":
            return {}
        kwargs: dict[str, Any] = {"dp_shard_size": self.dp_shard}
        if self.dp_replicate > 1:
            kwargs["dp_replicate_size"] = self.dp_replicate
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) > 1:
                kwargs[f"{name}_size"] = getattr(self, name)
        if self.pp > 1:
            kwargs["pp_schedule"] = self.pp_schedule
            kwargs["pp_microbatches"] = self.pp_microbatches
            if self.pp_stages_per_rank > 1:
                kwargs["pp_stages_per_rank"] = self.pp_stages_per_rank
        return kwargs

    def parallelism_config(self) -> ParallelismConfig | None:
        """The :class:`~slipstream.ParallelismConfig` of this layout (None: DDP, DeepSpeed)."""
        if self.engine != "fsdp":
            return None
        from ..parallel.config import ParallelismConfig

        return ParallelismConfig(**self.parallelism)

    def deepspeed_config(self, bucket_elements: int | None = None) -> dict[str, Any]:
        """The DeepSpeed configuration of a ZeRO layout (buckets bounded by
        ``bucket_elements``, the planner's choice for the model)."""
        stage = self.zero_stage
        zero: dict[str, Any] = {"stage": stage}
        if bucket_elements is not None:
            zero["reduce_bucket_size"] = bucket_elements
            zero["allgather_bucket_size"] = bucket_elements
            if stage == 3:
                zero.update(
                    stage3_prefetch_bucket_size=bucket_elements,
                    stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements,
                    stage3_param_persistence_threshold=bucket_elements // 100,
                    sub_group_size=bucket_elements * 4,
                )
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.offload == "all" and stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        return {
            "zero_optimization": zero,
            "gradient_clipping": 1.0,
            "gradient_accumulation_steps": self.accumulation,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "train_batch_size": self.micro_batch * self.accumulation * self.world_size,
        }

    def fsdp_options(self, wrap_classes: tuple[str, ...] = ()) -> dict[str, Any]:
        """FullyShardedDataParallelPlugin options for recomputation and offload (empty when
        neither is asked for: the strategy's defaults then shard each block on its own).
        Given options replace those defaults, so the blocks (``wrap_classes``) are named."""
        if self.engine != "fsdp" or (self.recompute == "none" and self.offload == "none"):
            return {}
        if self.recompute == "selective":
            raise ConfigError(
                "recompute='selective' is predicted for comparison with published runs; "
                "slipstream recomputes whole blocks: use recompute='full'"
            )
        options: dict[str, Any] = {
            "activation_checkpointing": self.recompute == "full",
            "cpu_offload": self.offload != "none",
            "state_dict_type": "SHARDED_STATE_DICT",
        }
        if wrap_classes:
            options["auto_wrap_policy"] = "transformer_based_wrap"
            options["transformer_cls_names_to_wrap"] = list(wrap_classes)
        return options

    def accelerator_kwargs(
        self, bucket_elements: int | None = None, wrap_classes: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """Keyword arguments of :class:`~slipstream.Accelerator` that run this layout
        (``wrap_classes``: the model's block classes, FSDP's units)."""
        kwargs: dict[str, Any] = {
            "mixed_precision": self.mixed_precision,
            "gradient_accumulation_steps": self.accumulation,
        }
        if self.engine == "fsdp":
            from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

            kwargs["parallelism_config"] = self.parallelism_config()
            options = self.fsdp_options(wrap_classes)
            if options:
                kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**options)
        elif self.engine.startswith("zero"):
            from ..strategies.deepspeed_plugin import DeepSpeedPlugin

            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
                hf_ds_config=self.deepspeed_config(bucket_elements)
            )
        return kwargs

    def as_dict(self) -> dict[str, Any]:
        return {"description": self.describe(), "family": self.family, **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Layout:
        fields = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in fields})


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
