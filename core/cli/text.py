"""Docstrings as ``--help`` shows them: plain text, without reStructuredText's markup.

The subcommands' modules document themselves once, in their docstring; argparse prints a
description verbatim, so ````literal```` quoting and ``:role:`name``` references are
turned into the plain words first.

Example::

    description("``slipstream config``: write a file.")   # 'slipstream config: write a file.'
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":\w+:`([^`]+)`")  # :func:`name` -> name
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)  # ``text`` -> text, also over a line break


def description(docstring: str, paragraphs: int | None = None) -> str:
    """``docstring`` as plain text; only its first ``paragraphs`` when given. A ``::`` that
    introduces an example becomes ``:``."""
    text = docstring.strip()
    if paragraphs is not None:
        text = "\n\n".join(text.split("\n\n")[:paragraphs])
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    return text.replace("::\n", ":\n")
