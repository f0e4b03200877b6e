"""Models whose weights hooks keep offloaded (CPU or disk; the module holds meta tensors
between forwards): their full state dict, read back from the offloaded copies, and the
refusal to train a quantized model that is offloaded.

Example::

    dispatch_model(model, {"encoder": "cpu", "decoder": "disk"}, offload_dir="offload/")
    state = state_dict_with_offloaded(model)     # real tensors everywhere, on the CPU
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .hooks import AlignDevicesHook, SequentialHook


def _offloading_hooks(module: nn.Module) -> list[AlignDevicesHook]:
    hook = module.__dict__.get("_hf_hook")
    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
    return [h for h in hooks if isinstance(h, AlignDevicesHook) and h.offload]


def state_dict_with_offloaded(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()``, with each weight a hook keeps offloaded read back from its
    CPU or disk copy (into memory of its own: the copy's file may be overwritten next, as
    when saving into the offload folder)."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        for hook in _offloading_hooks(module):
            weights = hook.weights_map
            if weights is None:
                continue
            release = getattr(weights, "release", None)
            for group in hook.groups:
                keys = [f"{prefix}.{name}" if prefix else name for name in group]
                if not any(k in state and state[k].device.type == "meta" for k in keys):
                    continue
                value = weights[group[0]].detach().to("cpu", copy=True)
                for key in keys:
                    if key in state:
                        state[key] = value.to(state[key].dtype)
                if release is not None:
                    release(group[0])
    return state


def refuse_offloaded_quantized(model: nn.Module) -> None:
    """A model loaded in 8 or 4 bits (bitsandbytes, by transformers) whose device map puts
    parts on the CPU or disk cannot be trained: say so before anything is wrapped."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(
        model, "is_loaded_in_4bit", False
    )
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not isinstance(device_map, dict):
        return
    offloaded = sorted(k for k, v in device_map.items() if str(v) in ("cpu", "disk"))
    if offloaded:
        raise ValueError(
            "a model loaded in 8-bit or 4-bit precision cannot be trained with CPU or disk "
            f"offload (hf_device_map puts {offloaded[:5]} there): load it with a device_map "
            "that keeps every module on a GPU, or without quantization"
        )
