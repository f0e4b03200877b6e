"""Which of Hugging Face Accelerate's public names slipstream provides, and how.

One row per name of ``accelerate``, ``accelerate.utils``, ``accelerate.logging`` and the
``Accelerator`` class's members: ``same`` (the same name with a compatible signature),
``different`` (provided, with a difference the note describes) or ``not provided`` (the
note says why and what to use instead). ``docs/compatibility.md`` is generated from these
rows (``python -m slipstream.compatibility``); ``slipstream migrate`` reports every use of a
name that is not provided with its note; a test keeps the rows complete and true.

Example::

    lookup("accelerate", "prepare_pippy")
    # Row(status='different', note='call the prepared model in eval mode ...')
"""

from __future__ import annotations

from dataclasses import dataclass

SAME, DIFFERENT, NOT_PROVIDED = "same", "different", "not provided"
#: The namespaces of the table, in the order the document lists them.
NAMESPACES = ("accelerate", "accelerate.utils", "accelerate.logging", "Accelerator")


@dataclass(frozen=True)
class Row:
    status: str
    note: str = ""


def _same(*names: str) -> dict[str, Row]:
    return {name: Row(SAME) for name in names}


def _rows(status: str, note: str, *names: str) -> dict[str, Row]:
    return {name: Row(status, note) for name in names}


#: namespace -> name -> row. Filled in per namespace below.
TABLE: dict[str, dict[str, Row]] = {namespace: {} for namespace in NAMESPACES}

TABLE["accelerate"].update(
    _same(
        "Accelerator",
        "AutocastKwargs",
        "DataLoaderConfiguration",
        "DeepSpeedPlugin",
        "DistributedDataParallelKwargs",
        "DistributedType",
        "FullyShardedDataParallelPlugin",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ParallelismConfig",
        "find_executable_batch_size",
        "notebook_launcher",
        "skip_first_batches",
    )
)
TABLE["accelerate"].update(
    _rows(
        DIFFERENT,
        "pipeline parallelism trains too: call the prepared model in eval mode for inference "
        "(ParallelismConfig(pp_size=...)), and accelerator.forward_backward to train",
        "prepare_pippy",
    )
)


TABLE["accelerate.utils"].update(
    _rows(
        NOT_PROVIDED,
        "Megatron-LM is not supported: use ParallelismConfig (tensor, pipeline and context "
        "parallelism with FSDP2) for the same layouts",
        "MegatronLMPlugin",
    )
)
TABLE["Accelerator"].update(
    _rows(
        NOT_PROVIDED,
        "LOMO optimizers are not supported: use a torch optimizer with accelerator.backward",
        "lomo_backward",
    )
)


def lookup(namespace: str, name: str) -> Row | None:
    """The row of ``name`` in ``namespace`` (``None`` when the table has none)."""
    return TABLE.get(namespace, {}).get(name)


def markdown() -> str:
    """``docs/compatibility.md``."""
    lines = [
        "# Compatibility with Hugging Face Accelerate",
        "",
        "Every public name of Accelerate 1.15's `accelerate`, `accelerate.utils` and "
        "`accelerate.logging`, and every public member of its `Accelerator`: **same** (the "
        "same name in `slipstream`, `slipstream.utils`, `slipstream.logging` or slipstream's "
        "`Accelerator`, with a compatible signature), **different** (provided, with the "
        "difference noted) or **not provided** (why, and what to use instead). "
        "`slipstream migrate` reports every use of a name that is not provided. This page is "
        "generated from `slipstream/compatibility.py` (`python -m slipstream.compatibility`); "
        "a test checks it against Accelerate's names and slipstream's.",
    ]
    for namespace in NAMESPACES:
        rows = TABLE[namespace]
        counts = {
            s: sum(r.status == s for r in rows.values()) for s in (SAME, DIFFERENT, NOT_PROVIDED)
        }
        lines += [
            "",
            f"## `{namespace}`",
            "",
            f"{counts[SAME]} same, {counts[DIFFERENT]} different, {counts[NOT_PROVIDED]} not provided.",
            "",
            "| name | status | notes |",
            "|---|---|---|",
        ]
        lines += [f"| `{name}` | {row.status} | {row.note} |" for name, row in sorted(rows.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
