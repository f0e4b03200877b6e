"""``slipstream estimate-memory MODEL``: memory per process to train or serve a model.

MODEL is ``module:callable`` (imported with the current directory on sys.path) or
``path/to/file.py:callable``; the callable returns an ``nn.Module`` and is called under
``torch.device("meta")``, so even a huge model costs no memory to measure.

The job: without --num_processes, the one the saved configuration describes (--config_file,
else the file ``slipstream config`` wrote): its processes, parallel sizes, strategy and
precision, named above the table; each flag overrides the file. With neither, one process.

Accounting (the ZeRO paper's, N = trainable parameters, P = processes), AdamW:

- fp32: weights 4N + gradients 4N + optimizer states (momentum, variance) 8N.
- bf16/fp16 mixed precision (DeepSpeed-style): 16-bit weights 2N + 16-bit gradients 2N +
  fp32 master weights, momentum and variance 12N.
- DDP shards nothing; ZeRO-1 shards the optimizer states over P; ZeRO-2 also the
  gradients; ZeRO-3 also the weights. FSDP is ZeRO-3 plus one gathered largest unit in the
  compute dtype (2 or 4 bytes per parameter).
- Frozen parameters count only as weights (bytes of the dtype), sharded only by ZeRO-3/FSDP.
- A shard holds ceil(n / P) elements, the padding FSDP and ZeRO add to split evenly.
- Inference is weights only: 4 bytes per parameter in fp32, 2 in bf16/fp16.
- --ep_size splits the experts of a mixture-of-experts model (its own ``base_model_ep_plan``,
  or --ep_plan patterns) over ep processes of the shard group: each holds 1/ep of them,
  sharded over dp_shard x cp / ep, and gathers 1/ep of an experts module at a time.
- --tp_size, --pp_size, --cp_size, --dp_replicate_size arrange the processes as
  dp_replicate x dp_shard x tp x pp x cp (dp_shard: what the others leave). A process holds
  1/tp of each weight the model's tensor-parallel plan splits (a transformers model's own
  plan, else every nn.Linear weight as a stand-in), the others whole; of that, a pipeline
  stage holds about 1/pp (stages balanced by parameter count); ZeRO/FSDP shard what a stage
  holds over dp_shard x cp (cp splits sequences, not weights). The table adds one dimension
  per row, so each row shows what it changes.
- Activations, model buffers, buffers of the data pipeline and framework overhead are not
  included. Sizes use binary units: 1 KB = 1024 B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..options.errors import ConfigError

# The model reading is shared with `slipstream plan` (the planning package); these names
# stay importable from here.
from ..planning.model_reading import (  # noqa: F401
    ParameterCounts,
    build_model,
    count_parameters,
    load_factory,
    split_parameters,
)
from .estimate_memory_job import DIMENSIONS, job_from
from .estimate_memory_parallel import ParallelLayout, TensorParallelSplit, notes
from .text import description

DTYPES = ("fp32", "bf16", "fp16")
STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP")
# Bytes per trainable parameter: (weights, gradients, optimizer states incl. fp32 master).
_TRAINING_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NOTES = "AdamW; activations, buffers of the data pipeline and framework overhead not included."
FOOTER = "Sizes in binary units (1 KB = 1024 B). " + NOTES


@dataclass(frozen=True)
class MemoryRow:
    """Bytes per process for one strategy at one dtype."""

    strategy: str
    dtype: str
    weights: int
    gradients: int
    optimizer_states: int
    gathered_unit: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.gathered_unit


def _check(num_processes: int, dtypes: Sequence[str]) -> None:
    if num_processes < 1:
        raise ConfigError(f"--num_processes must be at least 1, got {num_processes}")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise ConfigError(f"--dtypes must be among {', '.join(DTYPES)}, got {list(dtypes)}")


def estimate(
    counts: ParameterCounts, num_processes: int = 1, dtypes: Sequence[str] = DTYPES
) -> list[MemoryRow]:
    """Training memory per process, one row per (strategy, dtype), strategies outermost."""
    _check(num_processes, dtypes)

    def shard(elements: int, sharded: bool) -> int:
        return -(-elements // num_processes) if sharded else elements

    rows = []
    # The index in STRATEGIES is the ZeRO stage (DDP 0); FSDP shards like stage 3.
    for stage, strategy in enumerate(STRATEGIES):
        for dtype in dtypes:
            weight, gradient, optimizer = _TRAINING_BYTES[dtype]
            gathered = _WEIGHT_BYTES[dtype] * counts.largest_unit if strategy == "FSDP" else 0
            weights = weight * shard(counts.total, stage >= 3)  # frozen parameters too
            gradients = gradient * shard(counts.trainable, stage >= 2)
            states = optimizer * shard(counts.trainable, stage >= 1)
            rows.append(MemoryRow(strategy, dtype, weights, gradients, states, gathered))
    return rows


def inference_bytes(counts: ParameterCounts, dtypes: Sequence[str] = DTYPES) -> dict[str, int]:
    """Weights-only memory of one full copy of the model, per dtype."""
    _check(1, dtypes)
    return {dtype: _WEIGHT_BYTES[dtype] * counts.total for dtype in dtypes}


def format_bytes(size: float) -> str:
    """``size`` in B, KB, MB, GB or TB (binary: 1 KB = 1024 B)."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TB"


@dataclass(frozen=True)
class LayoutEstimate:
    """Memory per process under one parallel layout."""

    layout: ParallelLayout
    counts: ParameterCounts  # what one process holds before ZeRO/FSDP sharding
    training: tuple[MemoryRow, ...]
    inference: dict[str, int]


def estimate_layouts(
    counts: ParameterCounts,
    split: TensorParallelSplit,
    layout: ParallelLayout,
    dtypes: Sequence[str] = DTYPES,
) -> list[LayoutEstimate]:
    """Data parallel only, then each dimension of ``layout`` added in turn (its steps)."""
    estimates = []
    for step in layout.steps():
        share = split.per_process(step.tp, step.pp, step.ep)
        local = dataclasses.replace(
            counts, total=share.total, trainable=share.trainable, largest_unit=share.largest_unit
        )
        dense = dataclasses.replace(
            local,
            total=share.total - share.experts,
            trainable=share.trainable - share.trainable_experts,
        )
        training = estimate(dense, step.shard_group, dtypes)
        if share.experts:
            # Split experts are sharded only over the shard-group processes holding the same.
            experts = dataclasses.replace(
                local, total=share.experts, trainable=share.trainable_experts, largest_unit=0
            )
            expert_rows = estimate(experts, step.shard_group // step.ep, dtypes)
            training = [_add(a, b) for a, b in zip(training, expert_rows, strict=True)]
        estimates.append(
            LayoutEstimate(step, local, tuple(training), inference_bytes(local, dtypes))
        )
    return estimates


def _add(row: MemoryRow, other: MemoryRow) -> MemoryRow:
    return dataclasses.replace(
        row,
        weights=row.weights + other.weights,
        gradients=row.gradients + other.gradients,
        optimizer_states=row.optimizer_states + other.optimizer_states,
        gathered_unit=max(row.gathered_unit, other.gathered_unit),
    )


def _header(counts: ParameterCounts) -> str:
    return (
        f"{counts.total:,} parameters ({counts.trainable:,} trainable, {counts.frozen:,} "
        f"frozen), {counts.buffers:,} buffer elements, largest unit {counts.largest_unit:,} "
        "parameters (gathered whole by FSDP)"
    )


def _render(lines: list[list[str]], inference_rows: int) -> list[str]:
    width = max(len(line[0]) for line in lines)
    rendered = [line[0].ljust(width) + "".join(f"{c:>12}" for c in line[1:]) for line in lines]
    rendered.insert(1, "-" * len(rendered[0]))
    rendered.insert(len(rendered) - inference_rows, "-" * len(rendered[0]))
    return rendered


def format_table(
    counts: ParameterCounts, rows: list[MemoryRow], inference: dict[str, int], num_processes: int
) -> str:
    """The human-readable report: strategies down, dtypes across, then inference."""
    dtypes = list(inference)
    totals = {(row.strategy, row.dtype): format_bytes(row.total) for row in rows}
    lines = [
        [f"Training, per process of {num_processes}", *dtypes],
        *([s, *(totals[s, d] for d in dtypes)] for s in STRATEGIES),
        ["Inference (weights only)", *(format_bytes(inference[d]) for d in dtypes)],
    ]
    return "\n".join([_header(counts), "", *_render(lines, 1), "", FOOTER])


def format_parallel_table(
    counts: ParameterCounts, estimates: Sequence[LayoutEstimate], split: TensorParallelSplit
) -> str:
    """The report for a parallel layout: under each strategy one row per step of the layout,
    so each row shows what the dimension it adds saves."""
    layout = estimates[-1].layout
    dtypes = list(estimates[0].inference)
    width = max(len(s) for s in STRATEGIES)
    lines = [[f"Training, per process of {layout.num_processes}", *dtypes]]
    for strategy in STRATEGIES:
        for i, step in enumerate(estimates):
            totals = {r.dtype: r.total for r in step.training if r.strategy == strategy}
            label = f"{strategy if i == 0 else '':<{width}}  {step.layout.describe()}"
            lines.append([label, *(format_bytes(totals[d]) for d in dtypes)])

    def weights(inference: dict[str, int]) -> list[str]:
        return [format_bytes(inference[d]) for d in dtypes]

    inference = [["Inference (weights only)", *weights(estimates[0].inference)]]
    split_by = [f"{dim} {layout.size(dim)}" for dim in ("tp", "pp", "ep") if layout.size(dim) > 1]
    if split_by:  # cp and dp_replicate leave a serving process's weights whole
        inference.append([f"Inference, {' x '.join(split_by)}", *weights(estimates[-1].inference)])
    rendered = _render(lines + inference, len(inference))
    header = [_header(counts), *notes(layout, split, counts.total)]
    return "\n".join([*header, "", *rendered, "", FOOTER])


_PARALLEL_OPTIONS = (
    ("tp", "tensor-parallel size: splits the weights of the model's TP plan"),
    ("pp", "pipeline stages: each holds about 1/pp of the parameters"),
    ("cp", "context-parallel size: splits sequences; joins the ZeRO/FSDP shard group"),
    ("dp_replicate", "replicas of the sharded state (HSDP); ZeRO/FSDP shard within one"),
    ("ep", "expert-parallel size: splits the experts over processes of the shard group"),
)


def register(subparsers: Any) -> None:
    summary = "estimate memory per process to train or serve a model"
    parser = subparsers.add_parser(
        "estimate-memory",
        help=summary,
        description=description(__doc__),  # --help shows the accounting, laid out as written
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    parser.add_argument("model", help="module:callable or path/to/file.py:callable")
    parser.add_argument(
        "--num_processes",
        "--num-processes",
        type=int,
        default=None,
        help="processes (default: the saved config's, else 1)",
    )
    parser.add_argument(
        "--config_file",
        "--config-file",
        default=None,
        help="take the processes, layout, strategy and precision from this config (default: "
        "the one `slipstream config` wrote, when --num_processes is not given)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="columns (default all)"
    )
    for dim, meaning in _PARALLEL_OPTIONS:
        spellings = (f"--{dim}_size", f"--{dim.replace('_', '-')}-size")
        parser.add_argument(
            *spellings, type=int, default=None, help=f"{meaning} (default: the config's, else 1)"
        )
    parser.add_argument(
        "--ep_plan",
        "--ep-plan",
        help="comma-separated module-name patterns of the experts modules ('*' matches one "
        "part); default: the model's own base_model_ep_plan",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _rows_report(rows: Sequence[MemoryRow]) -> list[dict[str, Any]]:
    return [{**dataclasses.asdict(r), "total": r.total} for r in rows]


def _parallel_report(
    counts: ParameterCounts, split: TensorParallelSplit, estimates: Sequence[LayoutEstimate]
) -> dict[str, Any]:
    layout = estimates[-1].layout
    return {
        "layout": layout.as_dict(),
        "tensor_parallel": {
            "plan": "model" if split.from_plan else "nn.Linear weights (stand-in)",
            "split_parameters": split.split_elements,
            "split_modules": split.modules,
        },
        "experts": {"parameters": split.expert_elements, "ep": layout.ep},
        "notes": notes(layout, split, counts.total),
        # Data parallel only first, then one dimension added per step; the last is the layout.
        "steps": [
            {
                "layout": step.layout.as_dict(),
                "parameters_per_process": {
                    "total": step.counts.total,
                    "trainable": step.counts.trainable,
                    "frozen": step.counts.frozen,
                    "largest_unit": step.counts.largest_unit,
                },
                "training": _rows_report(step.training),
                "inference": step.inference,
            }
            for step in estimates
        ],
    }


def run(args: argparse.Namespace) -> int:
    dtypes = list(dict.fromkeys(args.dtypes))  # drop repeats, keep the order given
    # Before building: a typo should not wait on a model.
    if args.num_processes is not None:
        _check(args.num_processes, dtypes)
    sizes = {dim: getattr(args, f"{dim}_size") for dim in DIMENSIONS}
    job = job_from(args.num_processes, args.config_file, sizes, args.ep_plan)
    layout, ep_plan, num_processes = job.layout, job.ep_plan, job.layout.num_processes
    _check(num_processes, dtypes)
    model = build_model(args.model)
    counts = count_parameters(model)
    rows = estimate(counts, num_processes, dtypes)
    inference = inference_bytes(counts, dtypes)
    split, estimates = None, []
    if not layout.data_parallel_only or layout.ep > 1:
        split = split_parameters(model, layout.tp, layout.ep, ep_plan)
        estimates = estimate_layouts(counts, split, layout, dtypes)
    if args.json:
        report = {
            "model": args.model,
            "num_processes": num_processes,
            "job": job.as_dict(),
            "parameters": {**dataclasses.asdict(counts), "frozen": counts.frozen},
            # Data parallel over every process, as without the parallel options.
            "training": _rows_report(rows),
            "inference": inference,
            "unit": "bytes",
            "notes": NOTES,
        }
        if split is not None:
            report["parallel"] = _parallel_report(counts, split, estimates)
        print(json.dumps(report, indent=2))
    elif split is not None:
        print(job.describe())
        print(format_parallel_table(counts, estimates, split))
    else:
        print(job.describe())
        print(format_table(counts, rows, inference, num_processes))
    return 0
