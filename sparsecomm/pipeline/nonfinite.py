"""The pipeline's non-finite rule (``nonfinite="raise"``, the default; ``"skip"``; ``"pass"``).

``"raise"``: the same :class:`~sparsecomm.errors.NonFiniteError` on every worker when any worker's
bucket holds a NaN or Inf, whatever the compressor and transport. A compressed round checks the input
*before* compression (a sampling compressor would not see an unsampled NaN): the method's own compressed input
where the method checks it (:attr:`Method.checks_input <sparsecomm.methods.base.Method.checks_input>`: EF's
``g + e``, which a finite gradient overflows when the residual has grown near the dtype's largest value; on
exact rounds too, and under every mode), else the bucket (or, for a stateless method, its compressor's check
of the bucket); if it is not finite,
still encodes (zeros, so that generators and states advance alike) but sends NaN values (or a NaN
scale: :func:`poison`), so that the aggregate of *every* worker is non-finite; every round checks the
aggregate after the sum (:func:`check_aggregate`; a transport that cannot carry NaN, fixed point,
raises its own ``NonFiniteError`` on every worker, and then the pipeline does not check twice).

``"skip"``: the checks of ``"raise"`` (a non-finite input sent as NaN, so that every worker's sum is
non-finite), but a non-finite sum marks the step (:attr:`NonFiniteRule.flagged`) instead of raising: the
round runs no further round and no decode, and its estimate is NaN (so that ``torch.amp.GradScaler`` sees
it and skips the step), and the pipeline, which journals every method state and generator the step touches
(:meth:`CommPipeline.begin_step <sparsecomm.pipeline.core.CommPipeline.begin_step>`), restores them all
when the step ends (:meth:`~sparsecomm.pipeline.core.CommPipeline.end_step`): a skipped step changes no
method state and no generator on any worker, and is counted (``skipped_steps``). It needs a transport
that sums NaN/Inf through (not the fixed-point switch transports, which raise on them).

``"pass"``: as DDP, NaN/Inf flow into the averaged gradient where the compressor keeps them (a sampling
compressor may drop them; a method that checks its compressed input sends NaN from zeros instead, so it reaches
every worker; under a stateless method, compressors that check their input still raise, on that worker); a sum of
narrow floats that overflowed in its own dtype still raises :class:`~sparsecomm.errors.SumOverflowError`
(:func:`~sparsecomm.payload.check_sum_finite`).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from ..compressors.base import finite
from ..errors import NonFiniteError
from ..payload import Payload, check_sum_finite

NONFINITE = ("raise", "skip", "pass")

_HELP = ("a diverging model is the usual cause (a NaN/Inf gradient, or a finite one whose sum with the method's state "
         "overflowed: an error-feedback residual grown near the dtype's largest value): lower the learning rate "
         "(opt.step_size_hint.lr(lr) is what theory allows a compressed method if lr suits uncompressed training) "
         "or resume from a checkpoint taken before the state grew, check loss scaling, or find the "
         "first NaN with torch.autograd.set_detect_anomaly; nonfinite='skip' drops such a step on every worker "
         "with nothing changed (mixed precision: torch.amp.GradScaler), nonfinite='pass' lets NaN/Inf through "
         "as DDP does")


class NonFiniteRule:
    """The rule ``mode`` (one of :data:`NONFINITE`) over ``transport``: which checks a round makes,
    before its sum (:meth:`poisoned`) and after it (:meth:`plain_sum`, :meth:`sum`, :meth:`first_sum`,
    called only where :attr:`checks_sums` holds; each returns whether the sum is finite, which only
    ``"skip"`` can answer with False: the others raise or let it through)."""

    def __init__(self, mode: str, transport: Any) -> None:
        self.mode = mode
        #: whether inputs are checked and non-finite ones sent as NaN (``"raise"``, ``"skip"``)
        self.check = mode in ("raise", "skip")
        #: whether a non-finite sum marks the step (:attr:`flagged`) instead of raising
        self.skip = mode == "skip"
        #: whether a round of the current step had a non-finite sum (``"skip"``; reset by the pipeline
        #: at every step)
        self.flagged = False
        self.who = f"transport {transport.name!r}"
        #: whether a sum needs the pipeline's check: not when the transport raises on a non-finite sum (and
        #: on an overflow) itself, its ``nonfinite="raise"`` (fixed when the pipeline is built)
        self.checks_sums = self.skip or not (self.check and transport.nonfinite == "raise")

    def poisoned(self, x: torch.Tensor, exact: bool) -> bool:
        """Whether a compressed round's input ``x`` must be sent as NaN (see the module doc)."""
        return self.check and not exact and not finite(x)

    def _flag(self, agg: torch.Tensor) -> bool:
        if finite(agg):
            return True
        self.flagged = True
        return False

    def plain_sum(self, agg: torch.Tensor, key: Hashable) -> bool:
        """The check of an uncompressed round's sum."""
        if self.skip:
            return self._flag(agg)
        if self.check:
            check_aggregate(agg, key)
        return True

    def sum(self, payload: Any, agg: torch.Tensor, key: Hashable) -> bool:
        """The check of a compressed round's sum (a parameter-wise bucket, a later round)."""
        if self.skip:
            return self._flag(agg)
        if self.check:
            check_aggregate(agg, key)
        else:
            check_sum_finite(payload, agg, self.who)
        return True

    def first_sum(self, payload: Any, agg: torch.Tensor, key: Hashable) -> bool:
        """The check of a bucket-wide round's (first) sum: inputs were checked and no worker sent NaN,
        so a non-finite sum without NaN is narrow floats (fp16) overflowing in their own dtype, which
        :func:`~sparsecomm.payload.check_sum_finite` names (``SumOverflowError``, on every worker; under
        ``"skip"`` the step is skipped, as any non-finite sum)."""
        if self.skip:
            return self._flag(agg)
        if self.check and not finite(agg):
            if not bool(torch.isnan(agg).any()):
                check_sum_finite(payload, agg, self.who)
            check_aggregate(agg, key)
        else:       # narrow floats summed in their dtype: an overflow is not a passed-through NaN
            check_sum_finite(payload, agg, self.who)
        return True


def check_aggregate(agg: torch.Tensor, key: Hashable) -> None:
    """:class:`~sparsecomm.errors.NonFiniteError` when the sum ``agg`` of bucket ``key`` is not finite."""
    if not finite(agg):
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on at least one worker "
                             f"(the aggregate is not finite, or a float16/bfloat16 sum overflowed; raised on every "
                             f"worker); {_HELP}")


def poison(p: Payload, key: Hashable) -> None:
    """Make ``p`` (encoded from zeros) carry NaN, so every worker's aggregate is non-finite."""
    nan = float("nan")
    if p.values.is_floating_point() and p.values.numel():
        p.values.fill_(nan)
    elif p.scale is not None and p.scale.is_floating_point() and p.scale.numel():
        p.scale.fill_(nan)
    else:
        raise NonFiniteError(f"the gradients of bucket {key!r} hold a NaN or Inf on this worker and its "
                             f"{p.kind!r} payload cannot carry the fact to the other workers; {_HELP}")
