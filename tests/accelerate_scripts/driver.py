"""Run one of Accelerate's test scripts (already migrated to slipstream) and record, per test
function, whether it passed on each process.

    slipstream launch --num_processes 2 --cpu driver.py SCRIPT REPORT_DIR [--extras]
    python driver.py SCRIPT REPORT_DIR                 # scripts that start their own processes

The script's entry point (its ``if __name__ == "__main__":`` block, usually ``main()``) runs
unchanged. Every module-level function that the entry point calls as a statement is wrapped:
an exception is recorded as that call's failure and the entry point goes on, so one failing
function does not hide the others. With ``--extras`` the calls Accelerate's ``main()`` makes
only on GPUs (listed in EXTRA_CALLS) run first, with main()'s arguments. Each process appends
one JSON line per call to ``REPORT_DIR/rank<N>.jsonl`` as it goes, so a crash keeps what ran.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from itertools import product
from pathlib import Path
from typing import Any

#: Calls main() makes only on GPUs (or other accelerators); Accelerate passes them on CPU
#: processes when called. The same arguments main() passes there.
_FLAGS = list(product([True, False], repeat=3))
EXTRA_CALLS: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    "test_sync.py": [("test_gradient_accumulation", flags) for flags in _FLAGS]
    + [
        ("test_gradient_accumulation_with_opt_and_scheduler", flags)
        for flags in _FLAGS
        if any(flags)
    ],
    "test_metrics.py": [
        ("test_gather_for_metrics_with_iterable_dataset", ()),
        ("test_gather_for_metrics_with_non_tensor_objects_iterable_dataset", ()),
    ],
}
#: How long a collective may wait: a process that failed early must not hang the others
#: for torch's default 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def entry_point(tree: ast.Module) -> ast.If:
    """The script's ``if __name__ == "__main__":`` block."""
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        ):
            return node
    raise SystemExit("the script has no `if __name__ == '__main__':` block")


def called_functions(tree: ast.Module) -> list[str]:
    """Module-level functions the entry point (or main()) calls as statements, in order."""
    defined = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    bodies: list[ast.AST] = [entry_point(tree)]
    if "main" in defined:
        bodies.append(defined["main"])
    names: list[str] = []
    for body in bodies:
        for node in ast.walk(body):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id in defined
                and node.value.func.id != "main"
                and node.value.func.id not in names
            ):
                names.append(node.value.func.id)
    return names


class Recorder:
    """Appends one JSON line per call to this process's report."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, function: str, call: str, error: BaseException | None) -> None:
        record: dict[str, Any] = {"function": function, "call": call, "passed": error is None}
        if error is not None:
            frames = traceback.extract_tb(error.__traceback__)
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            message = str(error).strip().splitlines()
            record["error"] = f"{type(error).__name__}: {message[0] if message else ''}"[:300]
            record["where"] = where
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            call = _describe_call(name, args, kwargs)
            try:
                result = function(*args, **kwargs)
            except BaseException as error:  # the entry point goes on to the next function
                if isinstance(error, KeyboardInterrupt):
                    raise
                self.write(name, call, error)
                return None
            self.write(name, call, None)
            return result

        return recorded


def _describe_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def short(value: Any) -> str:
        if hasattr(value, "name") and hasattr(value, "value"):  # enum members
            return str(value.name)
        text = repr(value)
        return text if len(text) <= 40 and "object at" not in text else type(value).__name__

    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _join_short_timeout_group() -> None:
    """Form the process group before the script does (slipstream adopts it), with a short
    collective timeout."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)


def run(script: Path, report_dir: Path, extras: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    recorder = Recorder(report_dir / f"rank{rank}.jsonl")
    _join_short_timeout_group()
    tree = ast.parse(script.read_text())
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        recorder.write("<import>", "<import>", error)
        return
    for name in called_functions(tree):
        setattr(module, name, recorder.wrap(name, getattr(module, name)))
    if extras:
        for name, args in EXTRA_CALLS.get(script.name, []):
            getattr(module, name)(*args)
    block = ast.Module(body=entry_point(tree).body, type_ignores=[])
    try:
        exec(compile(block, str(script), "exec"), module.__dict__)
        recorder.write("<entry point>", "<entry point>", None)
    except BaseException as error:
        recorder.write("<entry point>", "<entry point>", error)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    run(Path(arguments[0]), Path(arguments[1]), "--extras" in arguments[2:])
    # Some scripts destroy their process group; the short-timeout one may still be ours.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
