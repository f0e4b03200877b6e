"""``slipstream migrate PATH...``: move a project from Hugging Face Accelerate.

* Python files: imports from ``accelerate`` (and ``accelerate.utils``, ``accelerate.logging``,
  ...) become imports from ``slipstream``, and ``accelerate.x`` attribute chains of an
  imported module follow; rewritten on a concrete syntax tree (libcst), so formatting and
  comments stay as they were.
* Shell scripts, Makefiles, YAML (CI), Dockerfiles, SLURM batch files: ``accelerate
  launch|config|env|test|estimate-memory|merge-weights`` become ``slipstream ...``.
* Every use of a name slipstream does not provide is reported as ``file:line`` with the
  reason from the compatibility table (:mod:`slipstream.compatibility`).

``--check`` changes nothing and exits 1 when something would change (for CI); ``--diff``
prints the changes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..options.errors import ConfigError

PYTHON = (".py",)
SCRIPTS = (".sh", ".bash", ".zsh", ".mk", ".yaml", ".yml", ".slurm", ".sbatch", ".cfg", ".toml")
SCRIPT_NAMES = ("Makefile", "makefile", "GNUmakefile", "Dockerfile")
SKIPPED_FOLDERS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".tox", "site"}
#: accelerate's modules -> slipstream's (others map to the top level, with a note).
MODULES = {
    "accelerate": "slipstream",
    "accelerate.utils": "slipstream.utils",
    "accelerate.logging": "slipstream.logging",
}
_COMMAND = re.compile(
    r"(?<![\w.-])accelerate(\s+)(launch|config|env|test|estimate-memory|merge-weights)\b"
)
_MODULE_COMMAND = re.compile(r"python3?\s+-m\s+accelerate\.commands\.(launch|config|env)\b")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _namespace(module: str) -> str:
    return MODULES.get(module, "slipstream")


def _table_namespace(module: str) -> str:
    return {"accelerate.utils": "accelerate.utils", "accelerate.logging": "accelerate.logging"}.get(
        module, "accelerate"
    )


def _missing(namespace: str, name: str) -> str | None:
    """Why ``name`` of ``namespace`` cannot be used, or None when it can."""
    from ..compatibility import NOT_PROVIDED, lookup

    row = lookup(namespace, name)
    if row is None or row.status != NOT_PROVIDED:
        return None
    return f"`{name}` ({namespace}) is not provided by slipstream: {row.note}"


def rewrite_python(source: str, path: str) -> tuple[str, list[Finding]]:
    """``source`` with Accelerate's imports turned into slipstream's, and the findings."""
    try:
        import libcst as cst
        from libcst.metadata import MetadataWrapper, PositionProvider
    except ImportError:
        raise ConfigError(
            "slipstream migrate rewrites Python files with libcst; install it with "
            "pip install 'slipstream[migrate]'"
        ) from None

    findings: list[Finding] = []

    class Rewriter(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.module_names: set[str] = set()  # `import accelerate` binds `accelerate`
            self.accelerators: set[str] = set()  # names bound to Accelerator(...)

        def _line(self, node: Any) -> int:
            return int(self.get_metadata(PositionProvider, node).start.line)

        def _note(self, node: Any, message: str) -> None:
            findings.append(Finding(path, self._line(node), message))

        def leave_ImportFrom(self, original: Any, updated: Any) -> Any:
            if original.module is None or original.relative:
                return updated
            # The original's name: attribute chains inside it may be renamed already.
            module = cst.helpers.get_full_name_for_node(original.module) or ""
            if module != "accelerate" and not module.startswith("accelerate."):
                return updated
            if module not in MODULES:
                self._note(
                    original,
                    f"`{module}` has no module of its own in slipstream: its names are "
                    "imported from `slipstream` (check they exist there)",
                )
            if not isinstance(updated.names, cst.ImportStar):
                for alias in updated.names:
                    name = cst.helpers.get_full_name_for_node(alias.name) or ""
                    reason = _missing(_table_namespace(module), name)
                    if reason:
                        self._note(original, reason)
            target = cst.parse_expression(_namespace(module))
            return updated.with_changes(module=target)

        def leave_Import(self, original: Any, updated: Any) -> Any:
            names = []
            for alias in updated.names:
                module = cst.helpers.get_full_name_for_node(alias.name) or ""
                if module == "accelerate" or module.startswith("accelerate."):
                    if alias.asname is None:
                        self.module_names.add(module.split(".")[0])
                    replacement = module.replace("accelerate", "slipstream", 1)
                    alias = alias.with_changes(name=cst.parse_expression(replacement))
                names.append(alias)
            return updated.with_changes(names=names)

        def visit_Assign(self, node: Any) -> None:
            call = node.value
            if isinstance(call, cst.Call):
                callee = cst.helpers.get_full_name_for_node(call.func) or ""
                if callee.split(".")[-1] == "Accelerator":
                    for target in node.targets:
                        if isinstance(target.target, cst.Name):
                            self.accelerators.add(target.target.value)

        def leave_Attribute(self, original: Any, updated: Any) -> Any:
            base = updated.value
            if isinstance(base, cst.Name) and base.value in self.accelerators:
                reason = _missing("Accelerator", updated.attr.value)
                if reason:
                    self._note(original, reason)
            if isinstance(base, cst.Name) and base.value in self.module_names:
                reason = _missing("accelerate", updated.attr.value)
                if reason:
                    self._note(original, reason)
                return updated.with_changes(value=cst.Name("slipstream"))
            return updated

    module = MetadataWrapper(cst.parse_module(source))
    rewritten = module.visit(Rewriter())
    return rewritten.code, findings


def rewrite_script(source: str) -> str:
    """Accelerate's commands in a shell script, Makefile or CI file, as slipstream's."""
    source = _MODULE_COMMAND.sub(lambda m: f"slipstream {m.group(1)}", source)
    return _COMMAND.sub(lambda m: f"slipstream{m.group(1)}{m.group(2)}", source)


def _kind(path: Path) -> str | None:
    if path.suffix in PYTHON:
        return "python"
    if path.suffix in SCRIPTS or path.name in SCRIPT_NAMES:
        return "script"
    return None


def files_under(paths: list[str]) -> list[Path]:
    """The files to migrate: the given files, and those under the given folders."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ConfigError(f"{raw} does not exist; give files or folders of the project")
        if path.is_file():
            found.append(path)
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders[:] = sorted(s for s in subfolders if s not in SKIPPED_FOLDERS)
            found += [Path(folder) / n for n in sorted(names) if _kind(Path(folder) / n)]
    return found


def migrate_file(path: Path) -> tuple[str, str, list[Finding]]:
    """``(before, after, findings)`` for one file (nothing written)."""
    before = path.read_text()
    kind = _kind(path)
    if kind == "python":
        try:
            after, findings = rewrite_python(before, str(path))
        except Exception as error:
            if type(error).__name__ != "ParserSyntaxError":
                raise
            return before, before, [Finding(str(path), 1, f"not valid Python, skipped: {error}")]
        return before, after, findings
    if kind == "script":
        return before, rewrite_script(before), []
    return before, before, []


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="rewrite a project's Accelerate imports and commands for slipstream",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    parser.add_argument("--diff", action="store_true", help="print the changes as a diff")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    changed: list[Path] = []
    findings: list[Finding] = []
    for path in files_under(args.paths):
        before, after, found = migrate_file(path)
        findings += found
        if after == before:
            continue
        changed.append(path)
        if args.diff:
            sys.stdout.writelines(
                difflib.unified_diff(
                    before.splitlines(keepends=True),
                    after.splitlines(keepends=True),
                    f"{path} (accelerate)",
                    f"{path} (slipstream)",
                )
            )
        if not args.check:
            path.write_text(after)
    verb = "would rewrite" if args.check else "rewrote"
    for path in changed:
        print(f"{verb} {path}")
    for finding in findings:
        print(finding)
    outcome = "would change" if args.check else "rewritten"
    print(f"slipstream migrate: {len(changed)} file(s) {outcome}, {len(findings)} finding(s)")
    return 1 if args.check and changed else 0
