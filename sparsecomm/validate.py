"""Checks of the numbers users pass to constructors and launchers, shared by every frontend: each returns
the value normalised (a Python ``int`` or ``float``) or raises at once, naming the argument, the value
and what is valid, instead of accepting it and failing later (a ``ZeroDivisionError`` at the first step,
a raw ``ValueError`` from ``int(nan)`` or ``Generator.manual_seed``) or never (a NaN compares false).

- :func:`check_int`: an integer (``bool`` is not one here; an integral float such as ``2.0`` is not
  one either), within bounds;
- :func:`check_real`: a real number, finite unless infinity is allowed, within bounds (open or closed);
- :func:`check_seed`: a seed every worker's generator accepts, ``seed + rank`` included.

A value of the wrong type is :class:`~sparsecomm.errors.InvalidTypeError`; NaN, infinity or a value out
of bounds is :class:`~sparsecomm.errors.InvalidValueError` (both subclass the builtin a caller expects).
"""

from __future__ import annotations

import math
import numbers

from .errors import InvalidTypeError, InvalidValueError

#: the largest seed (exclusive): ``seed + rank`` stays below 2**64, the range ``torch.Generator`` takes
SEED_END = 2 ** 63


def _bounds(low, high, low_open: bool = False, high_open: bool = False) -> str:
    lo = "" if low is None else ("> " if low_open else ">= ") + repr(low)
    hi = "" if high is None else ("< " if high_open else "<= ") + repr(high)
    return " and ".join(s for s in (lo, hi) if s)


def check_int(name: str, value, *, low: int | None = None, high: int | None = None, what: str = "") -> int:
    """``value`` as an ``int``, if it is an integer (not a ``bool``) in ``[low, high]`` (``None``: unbounded).

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        low: the smallest valid value.
        high: the largest valid value.
        what: who takes the argument (``"DistributedOptimizer"``), for the message.
    """
    where = f"{what}: " if what else ""
    rule = _bounds(low, high)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTypeError(f"{where}{name} must be an integer{' ' + rule if rule else ''}, got "
                               f"{value!r} ({type(value).__name__})")
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        raise InvalidValueError(f"{where}{name} must be an integer {rule}, got {v!r}")
    return v


def check_real(name: str, value, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, allow_inf: bool = False, what: str = "") -> float:
    """``value`` as a ``float``, if it is a real number (not a ``bool``), not NaN, finite unless
    ``allow_inf``, and within the bounds (``low_open``/``high_open``: the bound itself is excluded).

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        low: the lower bound (``None``: unbounded).
        high: the upper bound (``None``: unbounded).
        low_open: exclude ``low`` itself.
        high_open: exclude ``high`` itself.
        allow_inf: accept an infinity within the bounds.
        what: who takes the argument, for the message.
    """
    where = f"{what}: " if what else ""
    rule = _bounds(low, high, low_open, high_open)
    kind = "a real number" if allow_inf else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(f"{where}{name} must be {kind}{' ' + rule if rule else ''}, got {value!r} "
                               f"({type(value).__name__})")
    v = float(value)
    bad = math.isnan(v) or (math.isinf(v) and not allow_inf)
    bad = bad or (low is not None and (v <= low if low_open else v < low))
    bad = bad or (high is not None and (v >= high if high_open else v > high))
    if bad:
        raise InvalidValueError(f"{where}{name} must be {kind}{' ' + rule if rule else ''}, got {value!r}")
    return v


def check_seed(name: str, value, *, what: str = "") -> int:
    """``value`` as an ``int`` seed in ``[0, 2**63)`` (:data:`SEED_END`), so that every worker's
    ``seed + rank`` is a seed ``torch.Generator.manual_seed`` takes as it is (torch folds a negative seed
    onto a large one and refuses one past ``2**64 - 1``).

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        what: who takes the argument, for the message.
    """
    return check_int(name, value, low=0, high=SEED_END - 1, what=what)
