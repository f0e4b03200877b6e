"""``tqdm``: a progress bar drawn once per machine, not once per process.

Example::

    for batch in tqdm(loader, desc="training"):            # shown by local process 0
        ...
    for item in tqdm(items, main_process_only=False):      # every process draws its own
        ...
"""

from __future__ import annotations

from typing import Any

from ..runtime.progress import bar_options
from ..runtime.synchronize import process_state


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled except on each machine's main process
    (local process 0) unless ``main_process_only=False``; written to a log (not a terminal),
    each refresh is a line, at most every 30 s (:mod:`slipstream.runtime.progress`). Needs
    tqdm installed."""
    try:
        from tqdm.auto import tqdm as progress_bar
    except ImportError:
        raise ImportError("slipstream's tqdm needs tqdm installed: pip install tqdm") from None
    if args and isinstance(args[0], bool):
        raise ValueError(
            "pass main_process_only as a keyword (tqdm(iterable, main_process_only=True)); "
            "the first argument is the iterable"
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = process_state().local_process_index != 0
    # In a log file (not a terminal): a line per refresh, every 30 s, no carriage returns.
    return progress_bar(*args, disable=disable, **bar_options(kwargs))
