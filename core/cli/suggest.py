"""Unknown flags on the command line: name the nearest known one, as config keys do.

argparse alone says only ``unrecognized arguments: --num_proceses``; this module finds the
subcommand the flag was given to and suggests its closest flag (or a sub-action spelled as a
flag: ``slipstream config --default`` points to ``slipstream config default``).

Example::

    parser = build_parser()
    args, unknown = parser.parse_known_args(["launch", "--num_proceses", "2", "train.py"])
    refuse_unknown(parser, ["launch"], unknown)
    # slipstream launch: error: unrecognized arguments: --num_proceses (did you mean
    # --num_processes?)
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn


def nested_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-command parsers of ``parser`` by name (empty without sub-commands)."""
    # argparse has no public accessor for a parser's sub-commands; its actions list them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def innermost(
    parser: argparse.ArgumentParser, path: Sequence[str | None]
) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the deepest sub-command along ``path`` (``["config", "validate"]``) and
    the names that lead to it."""
    names: list[str] = []
    for name in path:
        nested = nested_parsers(parser)
        if name is None or name not in nested:
            break
        parser, names = nested[name], [*names, name]
    return parser, names


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    ]


def suggestion(parser: argparse.ArgumentParser, names: Sequence[str], token: str) -> str:
    """`` (did you mean --flag?)`` for an unknown ``token`` given to ``parser``, or ``""``."""
    if not token.startswith("-"):
        return ""
    flag = token.split("=", 1)[0]
    actions = nested_parsers(parser)
    # A sub-action written as a flag: `slipstream config --default`.
    bare = flag.lstrip("-").replace("-", "_")
    if bare in actions:
        return f" (did you mean 'slipstream {' '.join([*names, bare])}'?)"
    close = difflib.get_close_matches(flag, _flags(parser), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


def refuse_unknown(
    parser: argparse.ArgumentParser, path: Sequence[str | None], unknown: Sequence[str]
) -> NoReturn:
    """Exit 2 with argparse's usage and message for the subcommand at ``path``, naming the
    nearest known flag for each unknown one."""
    target, names = innermost(parser, path)
    # A value after an unknown flag is most likely its value: shown with it.
    groups: list[list[str]] = []
    for token in unknown:
        if token.startswith("-") or not groups or not groups[-1][0].startswith("-"):
            groups.append([token])
        else:
            groups[-1].append(token)
    listed = ", ".join(" ".join(group) + suggestion(target, names, group[0]) for group in groups)
    target.error(f"unrecognized arguments: {listed}")
