"""The small checkers every setting goes through (positive integer, integer, bool, choice): what
ShardConfig, EngineConfig, the pipeline split, the ZeRO optimizer and the tools validate with. Each
returns the value, or raises ValueError "<name>=<value> must be ...", naming what is expected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def is_positive_int(value: Any) -> bool:
    """An int >= 1 (a bool is not a number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(name: str, value: Any, *, optional: bool = False, why: str = "") -> Any:
    """``value`` if it is a positive integer (or None, when ``optional``); ``why`` ends the message."""
    if (value is None and optional) or is_positive_int(value):
        return value
    expected = "a positive integer or None" if optional else "a positive integer"
    raise ValueError(f"{name}={value!r} must be {expected}" + (f": {why}" if why else ""))


def check_int(name: str, value: Any) -> Any:
    """``value`` if it is an integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer")
    return value


def check_bool(name: str, value: Any) -> Any:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (a bool never is); the message lists numbers as
    "0, 1 or 2" and names as "one of 'a', 'b'"."""
    if value in choices and not isinstance(value, bool):
        return value
    shown = [repr(c) for c in choices]
    if all(isinstance(c, int) for c in choices):
        expected = " or ".join([", ".join(shown[:-1]), shown[-1]] if len(shown) > 1 else shown)
    else:
        expected = "one of " + ", ".join(shown)
    raise ValueError(f"{name}={value!r} must be {expected}")


def check_fields(config: Any, checker: Callable[[str, Any], Any], names: tuple[str, ...]) -> None:
    """Run ``checker`` on each named field, naming it ``<Class>.<field>`` in the message."""
    for name in names:
        checker(f"{type(config).__name__}.{name}", getattr(config, name))


def check_example_inputs(name: str, value: Any) -> Any:
    """None, a dict of keyword arguments (str keys) or a tuple / list of positional ones."""
    if (
        value is None
        or isinstance(value, (tuple, list))
        or (isinstance(value, dict) and all(isinstance(k, str) for k in value))
    ):
        return value
    raise TypeError(
        f"{name}={type(value).__name__} must be a dict of the forward's keyword arguments "
        f"({{'src': torch.randn(4, 10, 64)}}) or a tuple of its positional ones ((torch.randn(4, 10, 64),))"
    )
