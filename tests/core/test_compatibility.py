"""The compatibility table against Accelerate's names (tests/data/accelerate_names.json) and
slipstream's: a row for every name, rows that are true, signatures that accept what
Accelerate's accept, and docs/compatibility.md as the table renders it."""

from __future__ import annotations

import enum
import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import slipstream
import slipstream.logging
import slipstream.utils
from slipstream import Accelerator
from slipstream.compatibility import DIFFERENT, NAMESPACES, NOT_PROVIDED, SAME, TABLE, markdown
from tests.distributed import REPO

ACCELERATE = json.loads((REPO / "tests" / "data" / "accelerate_names.json").read_text())
MODULES = {
    "accelerate": slipstream,
    "accelerate.utils": slipstream.utils,
    "accelerate.logging": slipstream.logging,
}
Parameter = inspect.Parameter
POSITIONAL = (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)


def incompatibilities(function: Callable[..., Any], accelerate: list[list[Any]]) -> list[str]:
    """How calls written for Accelerate's parameters ``accelerate`` (``[name, kind,
    required]``) could fail with ``function``: a parameter missing or under another name,
    another order of positional parameters, a required parameter Accelerate does not require.

    Accelerate's ``**kwargs`` are not asked for: a catch-all says nothing about what callers
    pass (``find_tied_parameters`` ignores them, ``PartialState`` forwards them to
    ``init_process_group``); the named parameters are what a call spells out.
    """
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p for p in parameters if p.kind in POSITIONAL]
    by_keyword = {p.name for p in parameters if p.kind is not Parameter.POSITIONAL_ONLY}
    kinds = {p.kind for p in parameters}
    found = []
    theirs = [p for p in accelerate if p[1] == "positional"]
    for index, (name, _, _) in enumerate(theirs):
        if index < len(positional) and positional[index].name != name:
            found.append(f"argument {index + 1} is {positional[index].name!r}, not {name!r}")
        elif index >= len(positional) and Parameter.VAR_POSITIONAL not in kinds:
            found.append(f"{name!r} cannot be passed as argument {index + 1}")
    for name, kind, _ in accelerate:
        accepted = name in by_keyword or Parameter.VAR_KEYWORD in kinds
        if kind in ("positional", "keyword") and not accepted:
            found.append(f"no keyword {name!r}")
        if kind == "*args" and Parameter.VAR_POSITIONAL not in kinds:
            found.append("no *args")
    required_positions = {i for i, p in enumerate(theirs) if p[2]}
    required_names = {p[0] for p in accelerate if p[2]}
    for parameter in parameters:
        if parameter.default is not Parameter.empty or parameter.kind in (
            Parameter.VAR_POSITIONAL,
            Parameter.VAR_KEYWORD,
        ):
            continue
        index = positional.index(parameter) if parameter in positional else -1
        if parameter.name not in required_names and index not in required_positions:
            found.append(f"{parameter.name!r} is required")
    return found


def _names(namespace: str, *statuses: str) -> list[str]:
    return sorted(n for n, row in TABLE[namespace].items() if row.status in statuses)


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def _provider(namespace: str, accelerator: Accelerator) -> Any:
    return accelerator if namespace == "Accelerator" else MODULES[namespace]


# -- the checker itself ---------------------------------------------------------------------
def test_the_signature_check_finds_each_kind_of_difference():
    accelerate = [["tensor", "positional", True], ["dim", "positional", False]]

    def same(tensor, dim=0, *, state=None): ...
    def renamed(data, dim=0): ...
    def reordered(tensor, pad=0, dim=0): ...
    def short(tensor): ...
    def stricter(tensor, dim=0, *, state): ...
    def open_ended(tensor, **kwargs): ...

    assert incompatibilities(same, accelerate) == []
    assert incompatibilities(renamed, accelerate) == [
        "argument 1 is 'data', not 'tensor'",
        "no keyword 'tensor'",
    ]
    assert incompatibilities(reordered, accelerate) == ["argument 2 is 'pad', not 'dim'"]
    assert incompatibilities(short, accelerate) == [
        "'dim' cannot be passed as argument 2",
        "no keyword 'dim'",
    ]
    assert incompatibilities(stricter, accelerate) == ["'state' is required"]
    assert incompatibilities(open_ended, accelerate) == ["'dim' cannot be passed as argument 2"]
    assert incompatibilities(short, [["objects", "*args", False]]) == [
        "no *args",
        "'tensor' is required",
    ]
    assert incompatibilities(short, [["tensor", "keyword", True], ["kw", "**kwargs", False]]) == []


# -- the rows -------------------------------------------------------------------------------
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_accelerate_name_has_a_row_and_no_other(namespace: str):
    assert sorted(TABLE[namespace]) == sorted(ACCELERATE[namespace])


def test_rows_that_are_not_same_say_why():
    for namespace in NAMESPACES:
        for name, row in TABLE[namespace].items():
            assert row.status in (SAME, DIFFERENT, NOT_PROVIDED), (namespace, name)
            assert row.status == SAME or len(row.note) > 10, (namespace, name)
            assert "|" not in row.note, "a note must not break the markdown table"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_provided_names_exist_and_the_others_do_not(namespace: str, accelerator: Accelerator):
    provider = _provider(namespace, accelerator)
    provided = _names(namespace, SAME, DIFFERENT)
    assert [n for n in provided if not hasattr(provider, n)] == []
    not_provided = _names(namespace, NOT_PROVIDED)
    assert [n for n in not_provided if hasattr(provider, n)] == [], (
        "slipstream has these now: give them a same or different row"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_same_names_accept_accelerates_arguments(namespace: str, accelerator: Accelerator):
    provider = _provider(namespace, accelerator)
    signatures = ACCELERATE["signatures"][namespace]
    found = {
        name: problems
        for name in _names(namespace, SAME)
        if name in signatures
        and (problems := incompatibilities(getattr(provider, name), signatures[name]))
    }
    assert found == {}, "mark them different (with a note) or accept the arguments"


@pytest.mark.parametrize("namespace", ["accelerate", "accelerate.utils"])
def test_same_enums_have_every_member(namespace: str):
    found = {}
    for name, members in ACCELERATE["enum_members"][namespace].items():
        if TABLE[namespace][name].status != SAME:
            continue
        ours = getattr(MODULES[namespace], name)
        assert issubclass(ours, enum.Enum), name
        if missing := [m for m in members if m not in ours.__members__]:
            found[name] = missing
    assert found == {}


def test_accelerator_properties_are_attributes_and_methods_are_callable(
    accelerator: Accelerator,
):
    methods = ACCELERATE["signatures"]["Accelerator"]
    wrong = []
    for name in _names("Accelerator", SAME, DIFFERENT):
        value = getattr(accelerator, name)
        if (name in methods) != inspect.ismethod(value):
            wrong.append(name)
    assert wrong == [], "Accelerate's properties must not be methods here, nor the reverse"


# -- the document ---------------------------------------------------------------------------
def test_the_document_is_the_rendered_table():
    document = (REPO / "docs" / "compatibility.md").read_text()
    assert document == markdown(), (
        "regenerate it: python -m slipstream.compatibility > docs/compatibility.md"
    )
    for namespace in NAMESPACES:
        rows = TABLE[namespace]
        same = sum(r.status == SAME for r in rows.values())
        assert f"## `{namespace}`\n\n{same} same," in document
    assert "| `lomo_backward` | not provided | LOMO optimizers" in document


def test_the_module_prints_the_document():
    result = subprocess.run(
        [sys.executable, "-m", "slipstream.compatibility"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == markdown()
