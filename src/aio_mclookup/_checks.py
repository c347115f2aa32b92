"""Argument checks shared by every public entry point: one wording, one error type."""

from __future__ import annotations

import numbers

from ._errors import InvalidRequest

__all__ = ["integer", "positive_int"]


def positive_int(name: str, value: object, field: str | None = None) -> int:
    """``value`` as a plain int >= 1 (numpy ints included; bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise InvalidRequest(f"{name} must be a positive int, got {value!r}", field=field or name)
    return int(value)


def integer(name: str, value: object, field: str | None = None) -> int:
    """``value`` as a plain int (numpy ints included; bools refused)."""
    if type(value) is int:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(f"{name} must be an int, got {value!r}", field=field or name)
    return int(value)
