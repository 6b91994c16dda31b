"""The rules every transport applies to the values it sums: never a silent wrong number.

**Integers** are summed exactly or not at all. Each worker announces ``max |x|`` of its integer input
in the agreement header (an ``info`` field, no extra message); with the global maximum ``M`` every worker
picks the same accumulator (:func:`int_accumulator`): the input's own dtype when ``n M`` fits in it,
else the narrowest wider integer dtype that holds it (more bytes, only then). A sum accumulated wider
is narrowed back with a range check (:func:`narrow`): every worker holds the same sum, so an element
that does not fit the input's dtype is :class:`~sparsecomm.errors.OverflowError_` on every worker.
When ``n M`` exceeds even int64 the call raises before anything is sent.

**Floats** (:func:`guard_finite`): with ``nonfinite="raise"`` (the default of every transport) a sum
holding NaN or Inf is an error on every worker: every worker holds the same bits, so they all take the
error path together, and one extra agreement round (on the error path only) tells whether a worker's
input held NaN/Inf (:class:`~sparsecomm.errors.NonFiniteError`, naming the worker) or finite inputs
overflowed the dtype (fp16 sums past 65504: :class:`~sparsecomm.errors.OverflowError_`). The check
is one vectorised sum over the result (:func:`all_finite`). ``nonfinite="pass"`` sums NaN/Inf (and overflows to Inf) through as
``torch.distributed.all_reduce`` does, e.g. for AMP's GradScaler, which looks for them; the switch
cannot carry them (fixed point) and refuses ``"pass"``.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidValueError, NonFiniteError, OverflowError_, UnsupportedDtypeError

NONFINITE = ("raise", "pass")
#: the advice of a non-finite sum, before the option that lets NaN/Inf through
_LR_FIRST = ("a diverging model is the usual cause (a NaN/Inf gradient, or a finite one whose sum with a compression "
             "method's state overflowed: an error-feedback residual grown near the dtype's largest value): lower the "
             "learning rate (opt.step_size_hint.lr(lr): what theory allows if lr suits uncompressed training) or "
             "resume from a checkpoint taken before the state grew")


def nonfinite_option(value: str, transport: str) -> str:
    """Validate a transport's ``nonfinite=`` option."""
    if value not in NONFINITE:
        raise InvalidValueError(f"transport {transport!r}: nonfinite must be 'raise' (NaN/Inf is an error on every "
                         f"worker, the default) or 'pass' (summed through, as torch.distributed does), "
                         f"got {value!r}")
    return value


def check_dtype(dtype: torch.dtype, transport: str, supported: tuple[torch.dtype, ...] | None = None) -> None:
    """Raise :class:`~sparsecomm.errors.UnsupportedDtypeError` unless ``transport`` sums ``dtype`` tensors.

    ``bool`` is refused by every transport: the result has the input's dtype, and a ``bool`` cannot hold
    a sum (three ``True`` would come back ``True``, a logical or). ``supported``: the only dtypes the
    transport carries (its wire format's), ``None``: any other dtype."""
    if dtype == torch.bool:
        raise UnsupportedDtypeError(
            f"transport {transport!r} cannot sum torch.bool tensors: the result has the input's dtype, and a bool "
            f"cannot hold a sum (three True would read True); to count, pass x.to(torch.int32) (the sum is then "
            f"exact); for a logical or, compare that sum with 0")
    if supported is not None and dtype not in supported:
        raise UnsupportedDtypeError(
            f"transport {transport!r} cannot carry {dtype} tensors; it sums "
            f"{', '.join(str(d).replace('torch.', '') for d in supported)}")


def is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def abs_max(v: torch.Tensor) -> int:
    """``max |v|`` of an integer tensor as a Python int (0 when empty; no wrap for the most negative)."""
    if v.numel() == 0:
        return 0
    return max(int(v.max()), -int(v.min()))


_WIDTHS = (torch.int8, torch.int16, torch.int32, torch.int64)


def int_accumulator(dtype: torch.dtype, n: int, bound: int, what: str) -> torch.dtype:
    """The narrowest of ``dtype`` and the wider signed integer dtypes in which ``n`` integers, each
    ``|x| <= bound``, add up exactly (``dtype=torch.int8`` for quantized codes: the narrowest of all)."""
    total = n * int(bound)
    if total <= torch.iinfo(dtype).max:
        return dtype
    for wide in _WIDTHS:
        if torch.iinfo(wide).bits > torch.iinfo(dtype).bits and total <= torch.iinfo(wide).max:
            return wide
    raise OverflowError_(f"{what}: {n} workers' integers of magnitude up to {bound} can sum beyond int64; "
                         f"nothing was sent")


def narrow(total: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``total`` (a wider exact sum) as ``dtype``, or :class:`OverflowError_` if an element does not fit."""
    if total.dtype == dtype:
        return total
    info = torch.iinfo(dtype)
    if total.numel():
        lo, hi = int(total.min()), int(total.max())
        if lo < info.min or hi > info.max:
            bad = int(((total < info.min) | (total > info.max)).nonzero()[0, 0])
            raise OverflowError_(f"{what}: the sum of element {bad} is {int(total[bad])}, outside {dtype} "
                                 f"[{info.min}, {info.max}]; integers are never wrapped (sum in a wider dtype)")
    return total.to(dtype)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one vectorised reduction: a NaN or Inf element makes
    the sum NaN or Inf, so a finite sum proves every element finite (one read of ``t``, where
    ``isfinite(t).all()`` also writes a mask); only a non-finite sum, which finite elements can also
    give by overflowing, takes the exact element-wise check."""
    total = t.sum()
    if math.isfinite(total.item()) if not total.is_complex() else bool(torch.isfinite(total)):
        return True
    return bool(torch.isfinite(t).all())


def guard_finite(fabric, what: str, result: torch.Tensor, local: torch.Tensor | None, nonfinite: str,
                 cause=None) -> None:
    """Raise on every worker if the float sum ``result`` holds NaN/Inf (see the module docstring).

    ``result`` must be bit-identical on every worker. ``local`` is this worker's input (to find the
    cause); ``cause``, if given, is a function every worker can evaluate alike, returning the first worker
    whose input was non-finite (or -1 for none): then no extra round is needed.
    """
    if nonfinite == "pass" or not (result.is_floating_point() or result.is_complex()):
        return
    if result.numel() == 0 or all_finite(result):
        return
    # (the same text on every worker: every worker raises the same error)
    if cause is None:
        from ._handshake import check_agreement

        bad = 0 if local is None else int(not all_finite(local))
        got = check_agreement(fabric, what + " (non-finite check)", transport="nonfinite-check",
                              info={"nonfinite_input": bad, "input_overwritten": int(local is None)})
        flag, who = got["nonfinite_input"]
        if not flag and got["input_overwritten"][0]:
            raise NonFiniteError(f"{what}: the sum holds NaN or Inf: an input held "
                                 f"NaN/Inf or the sum overflowed {result.dtype} (summed in place, the inputs "
                                 f"are overwritten); {_LR_FIRST}; nonfinite='pass' sums them through")
    else:
        who = cause()
        flag = int(who >= 0)
    if flag:
        src = f"worker {who}" if who is not None else "a worker"
        raise NonFiniteError(f"{what}: {src} passed NaN or Inf values; {_LR_FIRST}; nonfinite='pass' "
                             f"to the transport sums them through as torch.distributed does")
    fi = torch.finfo(result.dtype)
    raise OverflowError_(f"{what}: the sum over workers overflowed {result.dtype} (largest finite value "
                         f"{fi.max:g}) although every worker's input is finite; sum in "
                         f"a wider dtype (for fp16 payloads: transport='allgather', which sums in the tensor's "
                         f"dtype, or compressor 'bf16') or scale the values down")
