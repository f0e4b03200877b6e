"""``python -m slipstream.compatibility`` prints docs/compatibility.md."""

from . import markdown

print(markdown(), end="")
