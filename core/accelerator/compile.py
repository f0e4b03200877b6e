"""torch.compile for prepared models (``dynamo_backend`` / ``TorchDynamoPlugin``).

The backend name is checked when the Accelerator is built; a compilation that fails later
(on the first forward) is re-raised as :class:`CompileError` naming the backend.

Example::

    accelerator = Accelerator(dynamo_backend="inductor")
    model = accelerator.prepare(model)          # compiled on its first call
    accelerator.unwrap_model(model)             # the original module
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from ..options.kwargs import KwargsHandler
from ..runtime.env import dynamo_environment, str_to_bool

#: The settings of a plugin made without arguments outside any launcher.
_DEFAULTS: dict[str, Any] = {
    "backend": "no",
    "mode": None,
    "fullgraph": False,
    "dynamic": None,
    "options": None,
}


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """``torch.compile`` settings: ``backend`` ("inductor", "aot_eager", ... or "no"),
    ``mode``, ``fullgraph``, ``dynamic`` and backend ``options``. Settings not given come
    from ``accelerate launch``'s variables (``ACCELERATE_DYNAMO_BACKEND``, ``_MODE``,
    ``_USE_FULLGRAPH``, ``_USE_DYNAMIC``) when set.

    Example::

        Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode="max-autotune"))
    """

    backend: str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        launcher = dynamo_environment()
        if self.backend is None:
            self.backend = launcher.get("backend", _DEFAULTS["backend"]).lower()
        if self.mode is None:
            self.mode = launcher.get("mode") or None
        if self.fullgraph is None:
            self.fullgraph = bool(str_to_bool(launcher.get("use_fullgraph", "false"), True))
        if self.dynamic is None and launcher.get("use_dynamic"):
            self.dynamic = bool(str_to_bool(launcher["use_dynamic"], True))

    def to_kwargs(self) -> dict[str, Any]:
        """The settings that differ from a plugin's defaults outside any launcher."""
        return {k: getattr(self, k) for k, v in _DEFAULTS.items() if getattr(self, k) != v}


class CompileError(RuntimeError):
    """torch.compile failed for the configured backend."""


def normalise_backend(backend: str | None) -> str:
    """Lower-case backend name; ``"no"`` when compilation is off."""
    if backend is None:
        return "no"
    name = str(backend).lower()
    return "no" if name in ("no", "none", "") else name


def check_backend(plugin: TorchDynamoPlugin) -> None:
    """Raise a clear error when ``plugin.backend`` is not a registered dynamo backend."""
    backend = normalise_backend(plugin.backend)
    if backend == "no":
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=None)
    if backend not in known:
        raise ValueError(
            f"unknown dynamo_backend {plugin.backend!r}; torch knows: {', '.join(sorted(known))} "
            "(or 'no' to run without compiling)"
        )


def compile_model(model: nn.Module, plugin: TorchDynamoPlugin) -> nn.Module:
    """``torch.compile(model)`` with the plugin's settings and a clearer failure."""
    import torch

    backend = normalise_backend(plugin.backend)
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": plugin.fullgraph}
    if plugin.mode is not None:
        kwargs["mode"] = plugin.mode
    if plugin.dynamic is not None:
        kwargs["dynamic"] = plugin.dynamic
    if plugin.options:
        kwargs["options"] = plugin.options
    compiled = cast(nn.Module, torch.compile(model, **kwargs))
    compiled_forward = compiled.forward

    @functools.wraps(compiled_forward)
    def forward(*args: Any, **kw: Any) -> Any:
        try:
            return compiled_forward(*args, **kw)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            raise CompileError(
                f"torch.compile with dynamo_backend={backend!r} failed: {error.inner_exception!r}. "
                "Pick another backend or set dynamo_backend='no'"
            ) from error

    compiled.forward = forward
    return compiled


def is_compiled(model: nn.Module) -> bool:
    return hasattr(model, "_orig_mod")
