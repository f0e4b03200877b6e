"""The layout docs/architecture.md states, checked: imports go down the layers it lists, no
modules import each other round a loop, and no source file grows past 500 lines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.distributed import REPO

ROOTS = {"slipstream": REPO / "core", "slipstream.integrations": REPO / "integrations"}
MAX_LINES = 500


def stated_layers() -> dict[str, int]:
    """Package -> layer, from the table under the 'layers' marker in docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers:", 1)[1].split("\n\n", 1)[0]
    layers: dict[str, int] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdecimal():
            for name in re.findall(r"`(\w+)`", cells[1]):
                layers[name] = int(cells[0])
    return layers


def source_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported slipstream module, line) for every import statement in the file, also those
    inside functions and under TYPE_CHECKING; ``from package import name`` counts the
    submodule when ``name`` is one."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node.lineno


def package_of(module: str) -> str | None:
    """The layer-table name of a module's package (``None`` for the root package)."""
    if module.startswith("slipstream.integrations"):
        return "integrations"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_stated_layer():
    layers = stated_layers()
    packages = {package_of(m) for m in source_modules()} - {None}
    assert packages - set(layers) == set(), (
        "packages missing from the layer table in docs/architecture.md: place them"
    )
    assert set(layers) - packages == set(), "the layer table names packages that do not exist"


def test_imports_go_down_the_layers():
    layers, modules = stated_layers(), source_modules()
    wrong: list[str] = []
    for module, path in sorted(modules.items()):
        mine = package_of(module)
        for target, line in imports_of(module, path, modules):
            theirs = package_of(target)
            if mine is None or theirs is None or theirs == mine:
                continue  # the root package is free to import; a package its own modules
            if layers[theirs] >= layers[mine]:
                where = path.relative_to(REPO)
                problem = (
                    f"{where}:{line}: {mine} (layer {layers[mine]}) imports {target} "
                    f"({theirs}, layer {layers[theirs]})"
                )
                if problem not in wrong:
                    wrong.append(problem)
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_no_modules_import_each_other_round_a_loop():
    modules = source_modules()
    edges = {
        module: {
            target
            for target, _ in imports_of(module, path, modules)
            # importing one's own package face (its __init__) is how submodules share names
            if not module.startswith(target + ".")
        }
        for module, path in modules.items()
    }
    loops = strongly_connected(edges)
    assert not loops, "import loops:\n" + "\n".join(" <-> ".join(loop) for loop in loops)


def test_no_source_file_is_over_500_lines():
    long = {
        str(path.relative_to(REPO)): count
        for path in source_modules().values()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by concept (one concept per module): {long}"


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of more than one node that reach each other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups
