"""Argument checks shared by the policies (a bad size from the engine is a bug: fail loudly)."""

from __future__ import annotations

import operator


def positive_int(value: object, what: str) -> int:
    """``value`` as a Python int (numpy integers accepted).

    TypeError unless it is an integer (bool is refused: True as a size is a caller
    bug), ValueError unless it is > 0.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return number
