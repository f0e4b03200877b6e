"""Regenerate ``accelerate_names.json``: Accelerate's public names and their signatures.

Reads Accelerate's source with :mod:`ast` (Accelerate need not be installed, nor importable)::

    python tests/data/make_accelerate_names.py /path/to/accelerate/src/accelerate

The file holds, per namespace, the public names (``accelerate`` and ``accelerate.utils``:
what their ``__init__`` imports; ``accelerate.logging``: what the module defines;
``Accelerator``: the methods and properties of the class) and, under ``signatures``, the
parameters of every callable one: ``[name, kind, required]`` with kind ``positional``,
``keyword`` (keyword-only), ``*args`` or ``**kwargs``. Classes record their ``__init__``
(a dataclass its fields); ``Accelerator`` properties record no parameters. Under
``enum_members``, every enum's member names.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).with_name("accelerate_names.json")
Param = list[Any]  # [name, kind, required]


class Source:
    """Accelerate's package folder; modules parsed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[Path, ast.Module] = {}

    def tree(self, path: Path) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(path.read_text(), str(path))
        return self.trees[path]

    def module_path(self, dotted: list[str]) -> Path | None:
        base = self.root.joinpath(*dotted)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def target_of(self, path: Path, node: ast.ImportFrom) -> list[str] | None:
        """The imported module as parts relative to the package root (None: not ours)."""
        if node.level == 0:
            parts = (node.module or "").split(".")
            return parts[1:] if parts[0] == "accelerate" else None
        here = list(path.relative_to(self.root).parent.parts)
        package = here[: len(here) - (node.level - 1)]
        return package + (node.module.split(".") if node.module else [])


def statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, including those inside ``if`` and ``try`` blocks."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            found += statements(node.body) + statements(node.orelse)
        elif isinstance(node, ast.Try):
            found += statements(node.body) + statements(node.orelse)
            for handler in node.handlers:
                found += statements(handler.body)
        else:
            found.append(node)
    return found


def imported_names(source: Source, path: Path) -> list[str]:
    names = set()
    for node in statements(source.tree(path).body):
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return sorted(n for n in names if not n.startswith("_"))


def defined_names(source: Source, path: Path) -> list[str]:
    return sorted(
        node.name
        for node in statements(source.tree(path).body)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    )


def function_params(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[Param]:
    arguments = node.args
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    params: list[Param] = [
        [a.arg, "positional", i < first_default] for i, a in enumerate(positional)
    ]
    if drop_first:
        params = params[1:]
    if arguments.vararg is not None:
        params.append([arguments.vararg.arg, "*args", False])
    for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
        params.append([a.arg, "keyword", default is None])
    if arguments.kwarg is not None:
        params.append([arguments.kwarg.arg, "**kwargs", False])
    return params


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _field_params(node: ast.ClassDef) -> list[Param]:
    params: list[Param] = []
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(item.annotation):
            continue
        value = item.value
        required = value is None
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
            keywords = {k.arg: k.value for k in value.keywords}
            init = keywords.get("init")
            if isinstance(init, ast.Constant) and init.value is False:
                continue
            required = "default" not in keywords and "default_factory" not in keywords
        params.append([item.target.id, "positional", required])
    return params


class Resolver:
    def __init__(self, source: Source) -> None:
        self.source = source

    def find(self, path: Path, name: str, depth: int = 0) -> tuple[Path, ast.stmt] | None:
        """The definition (def/class/assignment) of ``name`` as seen from ``path``."""
        if depth > 10:
            return None
        for node in statements(self.source.tree(path).body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    return path, node
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    target = self.source.target_of(path, node)
                    if target is None:
                        return None
                    module = self.source.module_path(target)
                    submodule = self.source.module_path([*target, alias.name])
                    if module is not None:
                        found = self.find(module, alias.name, depth + 1)
                        if found is not None:
                            return found
                    if submodule is not None:
                        return submodule, ast.Module(body=[], type_ignores=[])  # type: ignore[return-value]
                    return None
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return path, node
        return None

    def class_params(self, path: Path, node: ast.ClassDef, depth: int = 0) -> list[Param] | None:
        """``__init__``'s parameters; None for enums and exceptions (not called to build)."""
        bases = [ast.unparse(b) for b in node.bases]
        if any("Enum" in b or b.endswith(("Error", "Exception", "Warning")) for b in bases):
            return None
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                return function_params(item, drop_first=True)
        if "dataclass" in _decorator_names(node):
            inherited: list[Param] = []
            for base in node.bases:
                found = self.find(path, ast.unparse(base))
                if found is not None and isinstance(found[1], ast.ClassDef) and depth < 5:
                    base_params = self.class_params(found[0], found[1], depth + 1) or []
                    inherited += [p for p in base_params if p[0] not in {q[0] for q in inherited}]
            own = _field_params(node)
            names = {p[0] for p in own}
            return [p for p in inherited if p[0] not in names] + own
        for base in node.bases:
            found = self.find(path, ast.unparse(base))
            if found is not None and isinstance(found[1], ast.ClassDef) and depth < 5:
                return self.class_params(found[0], found[1], depth + 1)
        # No base at all: object(); a base from another library: unknown, not recorded.
        return [] if not node.bases else None

    def enum_members(self, path: Path, name: str) -> list[str] | None:
        """The member names of the enum ``name`` (None: not an enum)."""
        found = self.find(path, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        if not any("Enum" in ast.unparse(b) for b in found[1].bases):
            return None
        return [
            target.id
            for item in found[1].body
            if isinstance(item, ast.Assign)
            for target in item.targets
            if isinstance(target, ast.Name) and not target.id.startswith("_")
        ]

    def signature(self, path: Path, name: str) -> list[Param] | None:
        found = self.find(path, name)
        if found is None:
            return None
        where, node = found
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return function_params(node, drop_first=False)
        if isinstance(node, ast.ClassDef):
            return self.class_params(where, node)
        return None


def accelerator_members(source: Source) -> tuple[list[str], dict[str, list[Param]]]:
    path = source.root / "accelerator.py"
    cls = next(
        n for n in source.tree(path).body if isinstance(n, ast.ClassDef) and n.name == "Accelerator"
    )
    names, signatures = set(), {}
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith(
            "_"
        ):
            names.add(item.name)
            decorators = _decorator_names(item)
            if "property" in decorators or "setter" in decorators:
                continue
            signatures[item.name] = function_params(
                item, drop_first="staticmethod" not in decorators
            )
    return sorted(names), signatures


def generate(root: Path) -> dict[str, Any]:
    source = Source(root)
    resolver = Resolver(source)
    modules = {
        "accelerate": root / "__init__.py",
        "accelerate.utils": root / "utils" / "__init__.py",
        "accelerate.logging": root / "logging.py",
    }
    data: dict[str, Any] = {
        "accelerate": imported_names(source, modules["accelerate"]),
        "accelerate.utils": imported_names(source, modules["accelerate.utils"]),
        "accelerate.logging": defined_names(source, modules["accelerate.logging"]),
    }
    data["Accelerator"], accelerator_signatures = accelerator_members(source)
    version = next(
        node.value.value
        for node in source.tree(modules["accelerate"]).body
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "__version__"
        and isinstance(node.value, ast.Constant)
    )
    data["version"] = version
    signatures: dict[str, dict[str, list[Param]]] = {}
    for namespace, path in modules.items():
        signatures[namespace] = {}
        for name in data[namespace]:
            params = resolver.signature(path, name)
            if params is not None:
                signatures[namespace][name] = params
    signatures["Accelerator"] = accelerator_signatures
    data["signatures"] = signatures
    enums: dict[str, dict[str, list[str]]] = {}
    for namespace, path in modules.items():
        enums[namespace] = {}
        for name in data[namespace]:
            members = resolver.enum_members(path, name)
            if members is not None:
                enums[namespace][name] = members
    data["enum_members"] = enums
    return data


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    data = generate(Path(argv[0]))
    OUTPUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUTPUT} (Accelerate {data['version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
