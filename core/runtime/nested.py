"""Accelerate's helpers for nested batches: lists, tuples, namedtuples and dicts of tensors.

They walk the same structures as :mod:`slipstream.runtime.tree` (dataclasses included) and keep
each container's type. None of them talks to other processes; the collectives are in
:mod:`slipstream.runtime.collectives`.

Example::

    batch = {"x": torch.ones(8, 3), "y": [torch.zeros(8)]}
    find_batch_size(batch)                           # 8
    slice_tensors(batch, slice(0, 4))                # the first 4 samples of everything
    concatenate([batch, batch])                      # 16 samples
    recursively_apply(lambda t: t * 2, batch)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .tree import map_structure, map_tensors


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """Whether ``data`` is a namedtuple (a tuple with ``_fields`` and ``_asdict``)."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """The items of ``generator`` in a container of ``obj``'s type (list, tuple, namedtuple)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """``data`` with ``func(leaf, *args, **kwargs)`` in place of every leaf that passes
    ``test_type`` (tensors by default); other leaves stay, or raise a ``TypeError`` with
    ``error_on_other_type``. Lists, tuples and mappings are always entered; dataclasses
    are entered unless ``test_type`` accepts them.
    """

    def is_leaf(value: Any) -> bool:
        if isinstance(value, (list, tuple, Mapping)):
            return False
        return test_type(value) or not (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        )

    def apply(value: Any) -> Any:
        if test_type(value):
            return func(value, *args, **kwargs)
        if error_on_other_type:
            # Accelerate's wording: scripts and tests compare it.
            raise TypeError(
                f"Unsupported types ({type(value)}) passed to `{getattr(func, '__name__', func)!s}`. "
                "Only nested list/tuple/dicts of objects that are valid for "
                f"`{getattr(test_type, '__name__', test_type)!s}` should be passed."
            )
        return value

    return map_structure(apply, data, is_leaf)


@dataclasses.dataclass
class TensorInformation:
    """The shape and dtype of a tensor, to build an empty one like it."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(tensor_info: Any) -> bool:
    return isinstance(tensor_info, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """``data`` with a :class:`TensorInformation` in place of every tensor."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors in place of the :class:`TensorInformation` of ``data_structure``."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def find_batch_size(data: Any) -> int:
    """The length of the first tensor found (depth first) in ``data``.

    Raises ``ValueError`` for an empty container and ``TypeError`` when the first leaf is not
    a tensor.
    """
    while isinstance(data, (list, tuple, Mapping)):
        if len(data) == 0:
            raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
        data = next(iter(data.values())) if isinstance(data, Mapping) else data[0]
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return int(data.shape[0])


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or ``None`` where it raises."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def _to_list(tensor: torch.Tensor) -> Any:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()  # .tolist() goes through NumPy, which has no bfloat16
    return tensor.tolist()


def listify(data: Any) -> Any:
    """``data`` with plain Python numbers (nested lists) in place of tensors."""
    return recursively_apply(_to_list, data)


def slice_tensors(
    data: Any,
    tensor_slice: slice | int | tuple[Any, ...],
    process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """``tensor[tensor_slice]`` of every tensor of ``data`` (the last two arguments are
    ignored, as in Accelerate)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: list[Any] | tuple[Any, ...], dim: int = 0) -> Any:
    """Concatenate a list of equally structured batches along ``dim``, keeping the structure.

    Example::

        concatenate([{"x": a1, "y": b1}, {"x": a2, "y": b2}])  # {"x": cat(a), "y": cat(b)}
    """
    first = data[0]
    if len(data) == 1 and not isinstance(first, (list, tuple, Mapping, torch.Tensor)):
        return first  # one batch of something else: nothing to join (as Accelerate)
    if isinstance(first, (list, tuple)):
        return honor_type(
            first, (concatenate([d[i] for d in data], dim) for i in range(len(first)))
        )
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})  # type: ignore[call-arg]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    raise TypeError(
        f"can only concatenate tensors (in lists, tuples and dicts), got {len(data)} "
        f"{type(first).__name__} values; gather non-tensor objects with gather_object"
    )


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def convert_to_fp32(tensor: Any) -> Any:
    """``tensor`` (nested) with its float16/bfloat16 tensors converted to float32."""
    return map_tensors(_to_fp32, tensor)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so half-precision outputs come back in float32
    (``__wrapped__`` is the original).

    Example::

        model.forward = convert_outputs_to_fp32(model.forward)
    """

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad every tensor along ``dim`` with zeros so ``batch_size`` samples split evenly over
    ``num_processes`` (each process getting at least one).

    Example::

        pad_input_tensors(torch.ones(3, 4), batch_size=3, num_processes=4).shape  # (4, 4)
    """
    per_process = max(1, -(-batch_size // num_processes))
    target = per_process * num_processes

    def pad(value: torch.Tensor) -> torch.Tensor:
        if value.shape[dim] >= target:
            return value
        shape = list(value.shape)
        shape[dim] = target - value.shape[dim]
        return torch.cat([value, value.new_zeros(shape)], dim=dim)

    return recursively_apply(pad, tensor, error_on_other_type=True)


def merge_dicts(source: dict[Any, Any], destination: dict[Any, Any]) -> dict[Any, Any]:
    """Merge ``source`` into ``destination`` recursively (nested dicts are merged, other
    values replaced); returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination
