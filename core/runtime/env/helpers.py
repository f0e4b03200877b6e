"""Accelerate's environment helpers (``accelerate.utils`` names, exported by
``slipstream.utils``): reading flags and numbers from variables, and setting, clearing or
restoring variables for a block of code or a test.

Example::

    with patch_environment(master_port="29501"):
        ...                                   # MASTER_PORT=29501 inside the block
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

#: The values :func:`str_to_bool` reads as true and as false.
_YES = ("y", "yes", "t", "true", "on", "1")
_NO = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 (or True with ``to_bool``) for y/yes/t/true/on/1, 0 (False) for n/no/f/false/off/0.

    Example::

        str_to_bool("Yes")                # 1
        str_to_bool("off", to_bool=True)  # False
    """
    lowered = value.lower()
    if lowered in _YES:
        return True if to_bool else 1
    if lowered in _NO:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}; use one of {', '.join(_YES + _NO)}")


def get_int_from_env(env_keys: list[str] | tuple[str, ...], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether the variable ``key`` holds a true value (``default`` when unset)."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The value of the variable ``key``, or ``default`` when unset."""
    return os.environ.get(key, str(default))


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set the variables ``kwargs`` (names upper-cased, values as strings) inside the block;
    restore or remove them afterwards.

    Example::

        with patch_environment(master_port=29501):
            ...  # MASTER_PORT=29501 here
    """
    names = [key.upper() for key in kwargs]
    saved = {name: os.environ[name] for name in names if name in os.environ}
    for name, value in zip(names, kwargs.values(), strict=True):
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name in names:
            if name in saved:
                os.environ[name] = saved[name]
            else:
                os.environ.pop(name, None)


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty environment; the previous one is back afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _restoring_prefixed(prefixes: tuple[str, ...]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(prefixes)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorate a function (or every ``test*`` method of a class, subclasses included) so
    that ``ACCELERATE_*`` and ``SLIPSTREAM_*`` variables it sets are undone when it returns.
    """
    prefixes = ("ACCELERATE_", "SLIPSTREAM_")

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(function, "_purges_environment", False):
            return function

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _restoring_prefixed(prefixes):
                return function(*args, **kwargs)

        wrapper._purges_environment = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method):
                setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(  # type: ignore[assignment]
        lambda cls, **kw: wrap_tests(cls)
    )
    return func_or_cls
