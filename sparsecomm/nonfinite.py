"""The pipeline's non-finite rule (``nonfinite="raise"``, see :mod:`sparsecomm.pipeline`): the same
:class:`~sparsecomm.errors.NonFiniteError` on every worker when any worker's bucket holds a NaN or Inf
(a poisoned payload makes every worker's aggregate non-finite; every round checks its aggregate)."""

from __future__ import annotations

import math
from typing import Hashable

import torch

from .compressors._common import abs_max
from .errors import NonFiniteError
from .payload import Payload

NONFINITE = ("raise", "pass")


def _finite(x: torch.Tensor) -> bool:
    return math.isfinite(abs_max(x.reshape(-1))) if x.is_floating_point() else True


_NONFINITE_HELP = ("pass nonfinite='pass' to let NaN/Inf through as DDP does, or find the cause "
                   "(learning rate, loss scaling, torch.autograd.set_detect_anomaly)")


def _check_aggregate(agg: torch.Tensor, key: Hashable) -> None:
    if not _finite(agg):
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on at least one worker "
                             f"(the aggregate is not finite, or a float16/bfloat16 sum overflowed; raised on every "
                             f"worker); {_NONFINITE_HELP}")


def _poison(p: Payload, key: Hashable) -> None:
    """Make ``p`` (encoded from zeros) carry NaN, so every worker's aggregate is non-finite."""
    nan = float("nan")
    if p.values.is_floating_point() and p.values.numel():
        p.values.fill_(nan)
    elif p.scale is not None and p.scale.is_floating_point() and p.scale.numel():
        p.scale.fill_(nan)
    else:
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on this worker and its "
                             f"{p.kind!r} payload cannot carry the fact to the other workers; "
                             f"{_NONFINITE_HELP}")
