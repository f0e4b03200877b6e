"""Accelerate's module functions that ``transformers.Trainer`` calls, routed to slipstream's
for slipstream's objects.

``transformers/trainer.py`` imports ``skip_first_batches``, ``save_fsdp_model``,
``save_fsdp_optimizer``, ``load_fsdp_model`` and ``load_fsdp_optimizer`` from Accelerate
and calls them on its accelerator and loaders. Given slipstream's, Accelerate's functions
would turn the prepared loader into a plain DataLoader (losing the shard's position and
the evaluation bookkeeping) and write FSDP1-era files. :func:`route_trainer_functions`
replaces each of those names in ``transformers.trainer`` by a small dispatcher: calls with
slipstream's objects go to slipstream's function of the same name, every other call to
Accelerate's, unchanged, so an Accelerate-backed Trainer in the same process is unaffected.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

#: Marks a dispatcher, so routing twice (or after a reload of this module) wraps nothing twice.
_ROUTED = "_slipstream_routes"


def _is_prepared_loader(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    from slipstream.data.loader import PreparedDataLoader

    loader = args[0] if args else kwargs.get("dataloader")
    return isinstance(loader, PreparedDataLoader)


def _is_slipstream_accelerator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    from slipstream import Accelerator

    accelerator = args[1] if len(args) > 1 else kwargs.get("accelerator")
    return isinstance(accelerator, Accelerator)


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    from slipstream.data.prepare import skip_first_batches

    return skip_first_batches(dataloader, num_batches)


def _slipstream_function(name: str) -> Callable[..., Any]:
    import slipstream.utils

    return getattr(slipstream.utils, name)  # type: ignore[no-any-return]


#: name in transformers.trainer -> (which calls are slipstream's, slipstream's function).
ROUTES: dict[str, tuple[Callable[..., bool], Callable[[], Callable[..., Any]]]] = {
    "skip_first_batches": (_is_prepared_loader, lambda: _skip_first_batches),
    **{
        name: (_is_slipstream_accelerator, functools.partial(_slipstream_function, name))
        for name in (
            "save_fsdp_model",
            "save_fsdp_optimizer",
            "load_fsdp_model",
            "load_fsdp_optimizer",
        )
    },
}


def _dispatcher(
    original: Callable[..., Any],
    ours: Callable[..., bool],
    slipstream_function: Callable[[], Callable[..., Any]],
) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if ours(args, kwargs):
            return slipstream_function()(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(dispatch, _ROUTED, True)
    return dispatch


def route_trainer_functions() -> None:
    """Install the dispatchers in ``transformers.trainer`` (once; idempotent)."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        import transformers.trainer as module
    for name, (ours, function) in ROUTES.items():
        original = getattr(module, name, None)
        if original is None or getattr(original, _ROUTED, False):
            continue
        setattr(module, name, _dispatcher(original, ours, function))
