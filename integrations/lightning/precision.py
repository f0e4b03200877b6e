"""A Lightning ``Precision`` plugin backed by slipstream's core precision classes.

Lightning's precision flags ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
map onto the same core classes the Accelerator uses (:func:`slipstream.precision.make_precision`):
forward contexts are the core autocast, fp16 loss scaling, unscale-before-clip and skipped
steps go through the core precision's ``GradScaler``. With FSDP or DeepSpeed the precision
becomes the core strategy's ``mixed_precision`` instead (FSDP's MixedPrecisionPolicy, the
DeepSpeed engine's bf16/fp16), so no autocast runs around their forward.

Example::

    from slipstream.integrations.lightning import SlipstreamPrecision, SlipstreamStrategy
    trainer = Trainer(strategy=SlipstreamStrategy(precision="16-mixed"))  # fp16 + GradScaler
    SlipstreamPrecision("bf16-mixed").mode  # "bf16"
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from slipstream.precision import Precision, canonical_mode, make_precision

# canonical core mode -> Lightning's spelling (what ``trainer.precision`` shows)
_LIGHTNING_NAMES = {
    "no": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
    "bf16-true": "bf16-true",
    "fp16-true": "16-true",
    "fp8": "fp8",
}


class SlipstreamPrecision(LightningPrecision):
    """Lightning precision plugin that delegates to a core :class:`slipstream.precision.Precision`.

    Args:
        precision: a Lightning or slipstream spelling (``"bf16-mixed"``, ``"bf16"``,
            ``"16-mixed"``, ``"fp16"``, ``"32-true"``, ``"no"``, ``"bf16-true"``, ...).

    The strategy binds the plugin to its device and core strategy in ``setup``; until then
    it only knows its mode.
    """

    def __init__(self, precision: str = "32-true") -> None:
        self.mode = canonical_mode(precision)
        self.precision = _LIGHTNING_NAMES[self.mode]  # type: ignore[assignment]
        self.core: Precision | None = None
        self._strategy: Any = None  # the core strategy (backward, clip_grad_norm_)
        self._autocast = True
        self._steps_in_backward = False

    # -- binding ------------------------------------------------------------------------------
    def bind(self, strategy: Any, device: torch.device) -> None:
        """Attach to a core strategy: build the core precision for ``device``.

        A strategy that manages precision itself (DeepSpeed) gets the mode in its config and
        the plugin runs without autocast or loss scaler; FSDP casts parameters itself
        (MixedPrecisionPolicy) so the plugin keeps only the fp16 loss scaler.
        """
        manages = bool(getattr(strategy, "manages_precision", False))
        mode = "no" if manages else self.mode
        if self.core is None or self.core.mode != mode or self.core.device != device:
            # Kept across fit/validate/test of one Trainer: the fp16 loss scale carries on.
            self.core = make_precision(mode, device)
        self._strategy = strategy
        self._autocast = bool(getattr(strategy, "autocast_forward", True))
        self._steps_in_backward = bool(getattr(strategy, "steps_in_backward", False))

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.core.scaler if self.core is not None else None

    # -- model and forward ----------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.mode.endswith("-true") and self.core is not None:
            # "true" half: weights cast in place, inputs cast, outputs back in fp32 (core).
            return self.core.convert_model(module)
        return module

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.core is None or not self._autocast:
            return contextlib.nullcontext()
        return self.core.autocast()

    # -- backward and steps ---------------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        if self.core is not None:
            tensor = self.core.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: Any,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # The user's LightningModule.backward hook wins, except where the engine must run
        # backward itself (DeepSpeed), as with Lightning's own DeepSpeed strategy.
        if self._strategy is None or (
            not self._steps_in_backward and is_overridden("backward", model)
        ):
            model.backward(tensor, *args, **kwargs)
            return
        self._strategy.backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self._steps_in_backward:
            # DeepSpeed: the closure's backward already stepped the engine at the boundary.
            result = closure()
            self._after_closure(model, optimizer)
            if model.automatic_optimization and result is None:
                raise MisconfigurationException(
                    "returning None from training_step (skipping backward) is not supported "
                    "with DeepSpeed"
                )
            return result
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        result = closure()
        skip_unscaling = result is None and model.automatic_optimization
        if not skip_unscaling and not getattr(optimizer, "_step_supports_amp_scaling", False):
            # Unscale before on_before_optimizer_step and clipping see the gradients.
            scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return result
        output = scaler.step(optimizer, **kwargs)  # skipped when gradients overflowed
        scaler.update()
        return output

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self._steps_in_backward:
            return  # DeepSpeed clips inside its step (gradient_clipping from the Trainer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        parameters = list(self.main_params(optimizer))
        if self._strategy is None:
            torch.nn.utils.clip_grad_norm_(parameters, clip_val)
        else:
            # The core strategy knows how to take a global norm over shards (FSDP).
            self._strategy.clip_grad_norm_(parameters, float(clip_val))

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"SlipstreamPrecision({self.precision!r})"


def _mode_of(plugin: LightningPrecision) -> str:
    """The precision a Lightning plugin stands for; ValueError for plugins slipstream cannot
    express (double precision, bitsandbytes, Transformer Engine, custom subclasses)."""
    if isinstance(plugin, SlipstreamPrecision):
        return plugin.mode
    if type(plugin) is LightningPrecision:
        return "no"
    from lightning.pytorch.plugins.precision import (
        DeepSpeedPrecision,
        FSDPPrecision,
        HalfPrecision,
        MixedPrecision,
    )

    if type(plugin) in (MixedPrecision, HalfPrecision, FSDPPrecision, DeepSpeedPrecision):
        return canonical_mode(plugin.precision)
    supported = ", ".join(dict.fromkeys(_LIGHTNING_NAMES.values()))
    raise ValueError(
        f"SlipstreamStrategy cannot use the precision plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}); use Trainer(precision=...) with "
        f"one of {supported}, or SlipstreamStrategy(precision=...)"
    )


def to_slipstream_precision(plugin: LightningPrecision | str) -> SlipstreamPrecision:
    """Convert a Lightning precision plugin (or a precision name) to a SlipstreamPrecision."""
    if isinstance(plugin, SlipstreamPrecision):
        return plugin
    if isinstance(plugin, str):
        return SlipstreamPrecision(plugin)
    return SlipstreamPrecision(_mode_of(plugin))


def is_default_plugin(plugin: LightningPrecision) -> bool:
    """True for the plain fp32 plugin Lightning's connector creates when nothing is asked."""
    return type(plugin) is LightningPrecision
