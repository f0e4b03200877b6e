"""``slipstream migrate PATH...``: move a project from Hugging Face Accelerate.

* Python files: each name of a ``from accelerate... import`` goes to the slipstream module
  that really provides it (``accelerate.data_loader`` -> ``slipstream.data``,
  ``accelerate.utils.*`` -> ``slipstream.utils``, ``accelerate.state`` -> ``slipstream``,
  ...), decided by importing that module now; names slipstream lacks keep their import from
  ``accelerate`` (the statement is split). ``accelerate.x`` attribute chains of an imported
  module follow. Rewritten on a concrete syntax tree (libcst): formatting and comments stay.
* Shell scripts, Makefiles, YAML (CI), Dockerfiles, SLURM batch files: ``accelerate
  launch|config|env|test|estimate-memory|merge-weights`` become ``slipstream ...``.
* Reported as ``file:line``: names left on ``accelerate``, names slipstream provides
  differently, names the compatibility table (:mod:`slipstream.compatibility`) has no row
  for, and keywords a call passes that slipstream's function or class does not take.

``--check`` changes nothing and exits 1 when something would change (for CI); ``--diff``
prints the changes and writes nothing.
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
from .migrate_names import (
    MODULES,
    OTHER_MODULES,
    candidates,
    counterpart,
    declares,
    is_accelerate,
    load,
    member_findings,
    name_findings,
    provider,
    unknown_keywords,
)
from .text import description

__all__ = [
    "MODULES",
    "OTHER_MODULES",
    "Finding",
    "candidates",
    "files_under",
    "migrate_file",
    "provider",
    "rewrite_python",
    "rewrite_script",
]

PYTHON = (".py",)
SCRIPTS = (".sh", ".bash", ".zsh", ".mk", ".yaml", ".yml", ".slurm", ".sbatch", ".cfg", ".toml")
SCRIPT_NAMES = ("Makefile", "makefile", "GNUmakefile", "Dockerfile")
SKIPPED_FOLDERS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".tox", "site"}
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


def rewrite_python(source: str, path: str) -> tuple[str, list[Finding]]:
    """``source`` with Accelerate's imports turned into slipstream's, and the findings.

    Example::

        after, findings = rewrite_python("from accelerate import Accelerator\\n", "train.py")
        # after == "from slipstream import Accelerator\\n"
    """
    try:
        import libcst as cst
        from libcst.metadata import MetadataWrapper, PositionProvider
    except ImportError:
        raise ConfigError(
            "slipstream migrate rewrites Python files with libcst; install it with "
            "pip install 'slipstream[migrate]'"
        ) from None

    from ..compatibility import DIFFERENT

    findings: list[Finding] = []
    full_name = cst.helpers.get_full_name_for_node

    class Rewriter(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.package_names: set[str] = set()  # `import accelerate` binds `accelerate`
            self.module_aliases: dict[str, str] = {}  # local name -> slipstream module
            self.bound: dict[str, tuple[str, str]] = {}  # local -> (slipstream module, name)
            self.accelerators: set[str] = set()  # names bound to Accelerator(...)
            self.told: set[str] = set()  # members whose difference was told
            self.in_import = False

        def _note(self, node: Any, message: str) -> None:
            line = int(self.get_metadata(PositionProvider, node).start.line)
            finding = Finding(path, line, message)
            if finding not in findings:
                findings.append(finding)

        # -- from accelerate.X import a, b ------------------------------------------------
        def _import_from(self, module: str, node: Any, aliases: list[Any]) -> Any:
            """``node`` (an import of Accelerate's) importing ``aliases`` from ``module``,
            laid out as ``node`` was: the closing parenthesis where it was."""
            last, final = aliases[-1], node.names[-1]
            after = last.comma.whitespace_after if isinstance(last.comma, cst.Comma) else None
            if last is final:
                pass
            elif not isinstance(after, cst.ParenthesizedWhitespace):
                # `from x import a,` is not Python; `(a, b)` had no trailing comma either.
                if node.lpar is None or not isinstance(final.comma, cst.Comma):
                    aliases[-1] = last.with_changes(comma=cst.MaybeSentinel.DEFAULT)
            else:
                # One name a line: the whitespace after this comma indents the next name;
                # make it what the statement's last name had before `)` (a comment stays).
                ending = (
                    final.comma.whitespace_after if isinstance(final.comma, cst.Comma) else None
                )
                if isinstance(ending, cst.ParenthesizedWhitespace):
                    after = after.with_changes(last_line=ending.last_line)
                else:  # `name\n)`: the newline before `)` is the parenthesis's own
                    after = after.with_changes(indent=False, last_line=cst.SimpleWhitespace(""))
                    node = node.with_changes(
                        rpar=node.rpar.with_changes(whitespace_before=cst.SimpleWhitespace(""))
                    )
                aliases[-1] = last.with_changes(
                    comma=last.comma.with_changes(whitespace_after=after)
                )
            return node.with_changes(module=cst.parse_expression(module), names=aliases)

        def _split(self, original: Any, updated: Any) -> list[Any]:
            module = full_name(original.module) or ""
            if isinstance(updated.names, cst.ImportStar):
                target = counterpart(module)
                if target is None:
                    self._note(original, f"`{module}` has no slipstream counterpart; kept")
                    return [updated]
                self._note(original, f"`from {module} import *`: the names used are unchecked")
                return [updated.with_changes(module=cst.parse_expression(target))]
            groups: dict[str, list[Any]] = {}
            kept: list[Any] = []
            for alias in updated.names:
                name = full_name(alias.name) or ""
                target = provider(module, name)
                for message in name_findings(module, name, target):
                    self._note(original, message)
                if target is None:
                    kept.append(alias)
                    continue
                groups.setdefault(target, []).append(alias)
                local = alias.asname.name.value if alias.asname else name
                self.bound[local] = (target, name)
            parts = [self._import_from(t, updated, list(a)) for t, a in groups.items()]
            if kept:
                parts.append(self._import_from(module, updated, kept))
            return parts

        def _bind_slipstream(self, node: Any) -> None:
            """A file migrated already: its names are still checked in calls."""
            module = full_name(node.module) or ""
            if isinstance(node.names, cst.ImportStar):
                return
            for alias in node.names:
                name = full_name(alias.name) or ""
                local = alias.asname.name.value if alias.asname else name
                self.bound[local] = (module, name)

        def leave_SimpleStatementLine(self, original: Any, updated: Any) -> Any:
            body: list[list[Any]] = []
            for old, new in zip(original.body, updated.body, strict=True):
                module = ""
                if isinstance(old, cst.ImportFrom) and old.module is not None and not old.relative:
                    module = full_name(old.module) or ""
                if is_accelerate(module):
                    body.append(self._split(old, new))
                    continue
                if module == "slipstream" or module.startswith("slipstream."):
                    self._bind_slipstream(old)
                body.append([new])
            if len(body) == 1 and len(body[0]) > 1:
                first, *rest = body[0]
                lines = [updated.with_changes(body=[first])]
                return cst.FlattenSentinel(lines + [cst.SimpleStatementLine([s]) for s in rest])
            return updated.with_changes(body=[s for part in body for s in part])

        # -- import accelerate[.X] [as y] ---------------------------------------------------
        def visit_Import(self, node: Any) -> None:
            self.in_import = True  # its dotted names are paths, not uses

        def leave_Import(self, original: Any, updated: Any) -> Any:
            self.in_import = False
            names = []
            for alias in updated.names:
                module = full_name(alias.name) or ""
                if not is_accelerate(module):
                    names.append(alias)
                    continue
                target = counterpart(module)
                same_path = target == module.replace("accelerate", "slipstream", 1)
                if target is None or (alias.asname is None and not same_path):
                    # Without `as`, the code spells the path out: only the same path works.
                    self._note(original, f"`import {module}` has no slipstream counterpart; kept")
                    names.append(alias)
                    continue
                if alias.asname is None:
                    self.package_names.add("accelerate")
                else:
                    self.module_aliases[alias.asname.name.value] = target
                names.append(alias.with_changes(name=cst.parse_expression(target)))
            return updated.with_changes(names=names)

        # -- uses ---------------------------------------------------------------------------
        def visit_Assign(self, node: Any) -> None:
            call = node.value
            if isinstance(call, cst.Call):
                callee = full_name(call.func) or ""
                if callee.split(".")[-1] == "Accelerator":
                    for target in node.targets:
                        if isinstance(target.target, cst.Name):
                            self.accelerators.add(target.target.value)

        def _callee(self, func: Any) -> tuple[str, Any] | None:
            """What slipstream object a call reaches, with the name the code spells."""
            if isinstance(func, cst.Name) and func.value in self.bound:
                module, name = self.bound[func.value]
                return func.value, getattr(load(module), name, None)
            if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)):
                return None
            base, attr = func.value.value, func.attr.value
            if base in self.accelerators:
                accelerator = getattr(load("slipstream"), "Accelerator", None)
                return f"{base}.{attr}", getattr(accelerator, attr, None)
            target = self.module_aliases.get(base)
            if target is None and base in self.package_names:
                target = "slipstream"
            if target is None:
                return None
            return f"{base}.{attr}", getattr(load(target), attr, None)

        def visit_Call(self, node: Any) -> None:
            reached = self._callee(node.func)
            if reached is None or reached[1] is None:
                return
            keywords = [a.keyword.value for a in node.args if a.keyword is not None]
            for keyword in unknown_keywords(reached[1], keywords):
                self._note(
                    node, f"`{reached[0]}(..., {keyword}=...)`: slipstream's takes no `{keyword}`"
                )

        def visit_ImportFrom(self, node: Any) -> None:
            self.in_import = True

        def leave_ImportFrom(self, original: Any, updated: Any) -> Any:
            self.in_import = False
            return updated

        def leave_Attribute(self, original: Any, updated: Any) -> Any:
            base = updated.value
            if self.in_import or not isinstance(base, cst.Name):
                return updated  # an import's module path: the import statement is rewritten
            attr = updated.attr.value
            if base.value in self.accelerators:
                found = member_findings(attr)
                # A difference is told at the first use in the file; a missing member at each.
                if found is not None and (found[0] != DIFFERENT or attr not in self.told):
                    self.told.add(attr)
                    self._note(original, found[1])
            elif base.value in self.module_aliases:
                module = self.module_aliases[base.value]
                if not declares(load(module), attr):
                    self._note(original, f"`{attr}` is not provided by {module}")
            elif base.value in self.package_names:
                # `accelerate` itself is rebound to slipstream: every chain follows it.
                if load(f"slipstream.{attr}") is None:
                    target = provider("accelerate", attr)
                    for message in name_findings("accelerate", attr, target):
                        self._note(original, message.replace("; kept on accelerate", ""))
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
        description=description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    parser.add_argument(
        "--diff", action="store_true", help="print the changes as a diff; change nothing"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    changed: list[Path] = []
    findings: list[Finding] = []
    write = not (args.check or args.diff)
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
        if write:
            path.write_text(after)
    verb = "rewrote" if write else "would rewrite"
    for path in changed:
        print(f"{verb} {path}")
    for finding in findings:
        print(finding)
    outcome = "rewritten" if write else "would change"
    print(f"slipstream migrate: {len(changed)} file(s) {outcome}, {len(findings)} finding(s)")
    return 1 if args.check and changed else 0
