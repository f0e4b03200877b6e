"""``Accelerator.profile``: torch.profiler around a block, one trace file per process.

Example::

    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir="traces")) as prof:
        for batch in itertools.islice(loader, 5):
            train_step(batch)
            prof.step()
    # traces/profile_0.json, traces/profile_1.json, ... (open in Perfetto or chrome://tracing)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..options.kwargs import ProfileKwargs

if TYPE_CHECKING:
    from ..runtime.state import ProcessState

#: Trace file of process N in ``output_trace_dir`` (Accelerate's name).
PROFILE_PATTERN_NAME = "profile_{suffix}.json"


class ProfilingMixin:
    """Profiling for the Accelerator (settings from ``kwargs_handlers`` or the call)."""

    state: ProcessState
    profile_handler: ProfileKwargs | None

    def wait_for_everyone(self) -> None: ...

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler``; yields the profiler.

        With ``output_trace_dir`` every process writes ``profile_{process_index}.json``
        there when the block ends, and the processes then wait for each other.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        name = PROFILE_PATTERN_NAME.format(suffix=self.state.process_index)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, name))
        self.wait_for_everyone()
