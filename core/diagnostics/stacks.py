"""Python stacks for reports: a thread's frames as plain data, and which frame is the user's.

"Where in the user's code" is the innermost frame that is not in slipstream, torch, the
standard library or an installed package: the line of the training script that called into
whatever is waiting.

Example::

    frames = thread_stack()                  # this process's main thread
    user = user_frame(frames)                # {"file": "train.py", "line": 14, ...}
    print(format_frame(user))                # train.py:14 in <module>: time.sleep(600)
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from typing import Any

_SLIPSTREAM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    prefixes = {_SLIPSTREAM, os.path.dirname(os.__file__)}
    prefixes |= {
        paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths
    }
    try:
        import torch

        prefixes.add(os.path.dirname(os.path.abspath(torch.__file__)))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return tuple(sorted(p for p in prefixes if p))


_LIBRARIES = _library_prefixes()


def is_library(filename: str) -> bool:
    """Whether ``filename`` belongs to slipstream, torch, the standard library or an
    installed package (not to the user's code)."""
    return filename.startswith(_LIBRARIES) or filename.startswith("<")


def thread_stack(thread: threading.Thread | None = None, limit: int = 60) -> list[dict[str, Any]]:
    """The frames of ``thread`` (default: the main thread), outermost first, each
    ``{"file", "line", "function", "code"}``; at most ``limit`` innermost frames."""
    thread = thread or threading.main_thread()
    frame = sys._current_frames().get(thread.ident or -1)
    frames: list[dict[str, Any]] = []
    while frame is not None and len(frames) < limit:
        filename = frame.f_code.co_filename
        frames.append(
            {
                "file": filename,
                "line": frame.f_lineno,
                "function": frame.f_code.co_name,
                "code": linecache.getline(filename, frame.f_lineno).strip(),
            }
        )
        frame = frame.f_back
    frames.reverse()
    return frames


def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame of the user's code in ``frames`` (outermost first), else the
    innermost frame."""
    for frame in reversed(frames):
        if not is_library(str(frame.get("file", ""))):
            return frame
    return frames[-1] if frames else None


def format_frame(frame: dict[str, Any] | None) -> str:
    """``file:line in function: code``."""
    if frame is None:
        return "an unknown place"
    text = f"{frame['file']}:{frame['line']} in {frame['function']}"
    return text + (f": {frame['code']}" if frame.get("code") else "")


def format_stack(frames: list[dict[str, Any]], indent: str = "    ") -> list[str]:
    """Traceback-style lines for ``frames`` (outermost first)."""
    lines: list[str] = []
    for frame in frames:
        lines.append(
            f'{indent}File "{frame["file"]}", line {frame["line"]}, in {frame["function"]}'
        )
        if frame.get("code"):
            lines.append(f"{indent}  {frame['code']}")
    return lines
