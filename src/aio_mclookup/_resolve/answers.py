"""The store's answers, normalised: vLLM's rule is that only the value ``1`` means present.

Answers come as a list of ints (the usual case, read at C speed), a numpy array, or anything
else (compared one by one, as vLLM compares them).
"""

from __future__ import annotations

import array
import functools
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._arrays import BoolArray
from .._errors import InvalidRequest

__all__ = ["first_false", "leading_present", "present_keys"]


def present_keys(exists: Sequence[int] | npt.NDArray[Any], num_keys: int) -> BoolArray:
    """vLLM's rule per key: only the value ``1`` means present."""
    answers = _numeric_answers(exists)
    one_by_one = answers is None and isinstance(exists, (list, tuple))
    if answers is None:
        try:
            answers = np.asarray(exists)
        except ValueError as exc:  # ragged
            raise InvalidRequest(
                f"exists must hold one answer per key: {exc}", field="exists"
            ) from None
    if answers.ndim != 1 or answers.shape[0] != num_keys:
        raise InvalidRequest(
            f"exists must have one answer per key ({num_keys}), got shape "
            f"{answers.shape}"
        )
    if one_by_one or answers.dtype.kind not in "biuf":
        # compare like Python (and vLLM): "1" != 1, an int subclass uses its own ==
        values = exists.tolist() if isinstance(exists, np.ndarray) else exists
        return np.fromiter((a == 1 for a in values), bool, num_keys)
    present: BoolArray = np.asarray(answers == 1, dtype=bool)
    return present


def leading_present(exists: Sequence[int] | npt.NDArray[Any], n: int) -> int | None:
    """How many answers from the first are present, or None when the answers are not plain
    numbers (or not ``n`` of them): the caller then takes the general path."""
    if isinstance(exists, (list, tuple)):
        if len(exists) != n:
            return None
        raw = _answer_bytes(exists)
        if raw is not None:  # count the leading 1s at C speed
            return n - len(raw.lstrip(b"\x01"))
        if not _all_ints(exists):
            return None
        return len(list(itertools.takewhile(functools.partial(operator.eq, 1), exists)))
    answers = _numeric_answers(exists)
    if answers is None or answers.ndim != 1 or answers.shape[0] != n:
        return None
    miss = first_false(answers == 1)
    return n if miss is None else miss


def first_false(values: Sequence[object] | BoolArray, stop: int | None = None) -> int | None:
    """Index of the first falsy value (among the first ``stop``), or None when all are
    truthy."""
    if isinstance(values, np.ndarray):
        head = (values if stop is None else values[:stop]).astype(bool, copy=False)
        return None if head.all() else int(head.argmin())  # (the first False)
    falsy = map(operator.not_, values if stop is None else itertools.islice(values, stop))
    return next(itertools.compress(itertools.count(), falsy), None)  # stops at the first


def _all_ints(values: Sequence[object]) -> bool:
    """Every value an int (bools and numpy integers included), checked at C speed."""
    try:
        array.array("q", values)  # type: ignore[type-var]  # refusing non-ints is the point
    except (TypeError, OverflowError):
        return False
    return True


def _numeric_answers(exists: object) -> npt.NDArray[Any] | None:
    """Store answers as a numeric array when they plainly are numbers (every item of a list or
    tuple an int, bools included), else None: then they are compared one by one."""
    if isinstance(exists, np.ndarray):
        return exists if exists.dtype.kind in "biuf" else None
    if isinstance(exists, (list, tuple)):
        raw = _answer_bytes(exists)
        if raw is not None:
            return np.frombuffer(raw, dtype=np.uint8)
        try:
            answers = np.frombuffer(array.array("q", exists), dtype=np.int64)
        except (TypeError, OverflowError):  # floats, strings, None, nested, huge ints
            return None
        return answers if exists.count(1) == np.count_nonzero(answers == 1) else None
    return None


def _answer_bytes(exists: list[Any] | tuple[Any, ...]) -> bytes | None:
    """The answers as one byte each when they all fit (the usual 0 and 1): the fastest
    conversion. None when they do not (negative codes, big ints, not ints).

    Converting reads each answer's integer value (``__index__``) where vLLM tests
    ``answer == 1``; they agree for ints, bools and numpy integers. Answers that count
    differently (int subclasses overriding ``==``, say) make this None, so that the caller
    compares them one by one.
    """
    try:
        raw = bytes(exists)
    except (TypeError, ValueError):
        return None
    return raw if exists.count(1) == raw.count(1) else None
