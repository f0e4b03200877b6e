"""``docs/compatibility.md``, rendered from the rows and the test-script findings."""

from __future__ import annotations

from .scripts import CPU_ADAPTATIONS, SCRIPT_DIFFERENCES
from .table import DIFFERENT, NAMESPACES, NOT_PROVIDED, SAME, TABLE
from .unit_tests import UNIT_TEST_DIFFERENCES


def markdown() -> str:
    """The whole page."""
    lines = [
        "# Compatibility with Hugging Face Accelerate",
        "",
        "Every public name of Accelerate 1.15's `accelerate`, `accelerate.utils` and "
        "`accelerate.logging`, and every public member of its `Accelerator`: **same** (the "
        "same name in `slipstream`, `slipstream.utils`, `slipstream.logging` or slipstream's "
        "`Accelerator`, with a compatible signature), **different** (provided, with the "
        "difference noted) or **not provided** (why, and what to use instead). "
        "`slipstream migrate` reports every use of a name that is not provided. This page is "
        "generated from `slipstream/compatibility/` (`python -m slipstream.compatibility`); "
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
    return "\n".join(lines + _scripts_section() + _unit_tests_section()) + "\n"


def _scripts_section() -> list[str]:
    lines = [
        "",
        "## Accelerate's own test scripts",
        "",
        "The distributed test scripts that ship in the accelerate package "
        "(`accelerate/test_utils/scripts`: test_script, test_sync, test_ops, "
        "test_distributed_data_loop, external_deps/test_metrics, test_notebook, test_cli, "
        "test_merge_weights, test_ddp_comm_hook) run in the suite against slipstream on 2 CPU "
        "processes (`pytest tests/accelerate_scripts -s` prints every call), their imports "
        "rewritten by `slipstream migrate` and their checks untouched. Every test function "
        "their entry points call passes, also the calls `main()` makes only on GPUs "
        "(test_sync's accumulation variants, test_metrics' iterable-dataset checks), except:",
        "",
        "| script | function | why |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{script}` | `{function}` | {why} |"
        for (script, function), why in sorted(SCRIPT_DIFFERENCES.items())
    ]
    lines += [
        "",
        "Two scripts Accelerate runs on GPUs only need a change outside their checks:",
        "",
    ]
    lines += [
        f"- `{script}`: {why}."
        for script, changes in sorted(CPU_ADAPTATIONS.items())
        for _, _, why in changes
    ]
    return lines


def _unit_tests_section() -> list[str]:
    lines = [
        "",
        "## Accelerate's own unit tests",
        "",
        "The unit tests of Accelerate's repository (`tests/test_*.py` of the release's source "
        "distribution, downloaded at test time) run in the suite against slipstream in one "
        "pytest process (`pytest tests/accelerate_unit -s` prints every test), their imports "
        "rewritten by `slipstream migrate` and their checks untouched. Tests of Accelerate's "
        "internals (private attributes, its command-line tool's builders, names slipstream "
        "does not provide) are out of scope: tests/accelerate_unit/README.md lists them and "
        "why. Every in-scope test passes (or skips for want of a GPU or an optional "
        "tracker), except:",
        "",
        "| test | why |",
        "|---|---|",
    ]
    lines += [f"| `{test}` | {why} |" for test, why in sorted(UNIT_TEST_DIFFERENCES.items())]
    return lines
