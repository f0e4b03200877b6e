"""What one training sample costs each part of a model: the activation bytes autograd keeps
for backward and the forward FLOPs, read by running the model once on the meta device (no
memory, no arithmetic: only shapes and dtypes).

Per unit of the model (its pipeline units: the embedding, each decoder layer, the final
norm and head; one unit for models that cannot be split) the trace records:

- ``saved``: bytes of the tensors autograd saves for backward, each storage once, without
  parameters and buffers (a parameter's cast copy under mixed precision counts);
- ``inputs``: bytes of the unit's first input (what full recomputation keeps instead);
- ``largest``: the largest saved tensor (backward's working set is a few of them);
- ``flops``: forward FLOPs (matrix products, and attention).

Two stand-ins keep the trace faithful where meta tensors cannot run the real kernel:
attention is memory-efficient (flash / SDPA kernels: it saves q, k, v, its output and the
log-sum-exp, never the score matrix; causal attention does half the products), and an
experts module computes every token's ``top_k`` experts as if routing were balanced (the
data-dependent grouping cannot run without data).

Example::

    traces = trace_units(model, {"input_ids": ids, "labels": ids}, ["model.embed_tokens", ...])
    traces["model.layers.0"].saved
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class UnitTrace:
    """One unit's share of a forward pass (bytes and FLOPs, for the traced batch)."""

    saved: int = 0
    inputs: int = 0
    largest: int = 0
    flops: float = 0.0
    #: What selective recomputation keeps (torchtitan's op policy): the outputs of every
    #: other matrix product of the unit and of its attention.
    selective: int = 0
    products: int = 0


class _Recorder:
    def __init__(self, units: Sequence[str], excluded: set[int]) -> None:
        self.traces = {name: UnitTrace() for name in units}
        self.current = units[0]
        self.excluded = excluded
        self.seen: set[int] = set()
        self.keep: list[torch.Tensor] = []  # keeps storages alive, so their ids stay unique
        self.kept: set[int] = set()

    def keep_output(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as kept by selective recomputation (once per storage)."""
        storage = tensor.untyped_storage()
        if storage._cdata not in self.kept:
            self.kept.add(storage._cdata)
            self.keep.append(tensor)
            self.traces[self.current].selective += storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.excluded and key not in self.seen:
            self.seen.add(key)
            self.keep.append(tensor)
            trace = self.traces[self.current]
            trace.saved += storage.nbytes()
            trace.largest = max(trace.largest, storage.nbytes())
        return tensor


class _FlashAttention(torch.autograd.Function):
    """What a memory-efficient attention kernel keeps for backward, on meta tensors."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # pragma: no cover - never run
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@contextlib.contextmanager
def _attention_stand_in(recorder: _Recorder) -> Iterator[None]:
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
        *batch, queries, head = query.shape
        keys = key.shape[-2]
        # Two products (scores, weighted values), 2 FLOPs each; a causal mask halves them.
        flops = 4.0 * float(torch.Size(batch).numel()) * queries * keys * head
        causal = is_causal or attn_mask is not None
        recorder.traces[recorder.current].flops += flops / 2 if causal else flops
        out = _FlashAttention.apply(query, key, value)
        recorder.keep_output(out)
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        recorder.traces[recorder.current].selective += lse.untyped_storage().nbytes()
        return out

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _balanced_experts(module: nn.Module) -> Any:
    """A forward for a stacked experts module (3-D weights [experts, ., .]) that sends each
    token through ``top_k`` experts' weights, as balanced routing would on average."""
    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]

    def forward(hidden: torch.Tensor, index: torch.Tensor, scores: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        width = hidden.shape[-1]
        top_k = index.shape[-1]
        rows = hidden.reshape(-1, width).repeat_interleave(top_k, dim=0)
        x = rows
        for position, weight in enumerate(weights):
            matrix = weight[0]
            x = x @ (matrix.t() if matrix.shape[-1] == x.shape[-1] else matrix)
            following = weights[position + 1] if position + 1 < len(weights) else None
            if following is not None:
                wanted = following[0].shape[-1 if following[0].shape[-1] != width else 0]
                if x.shape[-1] == 2 * wanted:  # gate and up projections side by side
                    gate, up = x.chunk(2, dim=-1)
                    x = torch.nn.functional.silu(gate) * up
                else:
                    x = torch.nn.functional.silu(x)
        combined = x.view(-1, top_k, width) * scores.reshape(-1, top_k, 1).to(x.dtype)
        return combined.sum(dim=1).view(hidden.shape)

    return forward


_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")


class _ProductMode(TorchDispatchMode):
    """Marks every other matrix product's output of a unit as kept (torchtitan's selective
    recomputation policy: save the products' outputs but recompute every second one)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _PRODUCTS and isinstance(out, torch.Tensor):
            trace = self.recorder.traces[self.recorder.current]
            trace.products += 1
            if trace.products % 2 == 1:
                self.recorder.keep_output(out)
        return out


def trace_units(
    model: nn.Module,
    inputs: Mapping[str, Any],
    units: Sequence[str],
    experts: Sequence[nn.Module] = (),
) -> dict[str, UnitTrace]:
    """Run ``model(**inputs)`` on the meta device and attribute saved bytes and FLOPs to
    ``units`` (module names in forward order; ``[""]``: the whole model is one unit)."""
    from torch.utils.flop_counter import FlopCounterMode

    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    recorder = _Recorder(units, excluded)
    handles = []
    modules = dict(model.named_modules())
    for name in units:
        if not name:
            continue

        def enter(module: nn.Module, args: Any, kwargs: Any, unit: str = name) -> None:
            recorder.current = unit
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if tensors and recorder.traces[unit].inputs == 0:
                recorder.traces[unit].inputs = tensors[0].untyped_storage().nbytes()

        handles.append(modules[name].register_forward_pre_hook(enter, with_kwargs=True))
    for module in experts:
        module.forward = _balanced_experts(module)
    counter = FlopCounterMode(display=False)
    try:
        with (
            _attention_stand_in(recorder),
            counter,
            _ProductMode(recorder),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda tensor: tensor),
        ):
            output = model(**inputs)
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            # The caller keeps the outputs alive through backward (forward_backward does).
            storage = logits.untyped_storage()
            if storage._cdata not in recorder.seen:
                recorder.traces[units[-1]].saved += storage.nbytes()
    finally:
        for handle in handles:
            handle.remove()
        for module in experts:
            del module.forward
    _add_counted_flops(recorder, counter, type(model).__name__, units)
    return recorder.traces


def _add_counted_flops(recorder: _Recorder, counter: Any, root: str, units: Sequence[str]) -> None:
    counts = counter.get_flop_counts()
    for name in units:
        key = f"{root}.{name}" if name else root
        recorder.traces[name].flops += float(sum(counts.get(key, {}).values()))
    if len(units) > 1:  # what ran outside every unit (e.g. the loss) belongs to the last
        inside = sum(float(sum(counts.get(f"{root}.{n}", {}).values())) for n in units)
        outside = float(sum(counts.get(root, {}).values())) - inside
        recorder.traces[units[-1]].flops += max(0.0, outside)
