"""The step size theory prescribes for a pipeline's method, relative to uncompressed training: the
method's variance factor (omega of an unbiased compressor, delta of a contractive one) and the scale
:func:`sparsecomm.theory.rates.step_scale` puts on a learning rate tuned without compression
(:class:`StepSizeHint`, ``opt.step_size_hint`` and ``state.step_size_hint`` of the DDP hook), and the
one-line :class:`StepSizeWarning` the frontends give at construction when that scale is small.

The scale depends on the compressor's constant at the sizes it compresses (the largest omega, the
smallest delta, over the optimizer's compressed buckets or the hook's parameters) and on how many
workers' compression errors average out: every worker for independent compressors, one when every
worker draws the same coordinates (``shared_randomness``, shared-seed rand-k), where the mean of the
messages is the compressor applied to the mean and its variance does not shrink with the workers.

The theory does not know the problem's smoothness L, so the hint is a factor, not a learning rate:
``hint.lr(base)`` is the learning rate theory allows if ``base`` suits the same run uncompressed. Two
rules (:func:`~sparsecomm.theory.rates.step_scale`): the theorems' **worst case** (``hint.scale``,
``hint.lr(base)``: any data split; the default, and what the warning's threshold uses) and the
**i.i.d.-data rule** 1/(1 + omega/n) (``hint.iid_scale``, ``hint.lr(base, rule="iid")``: every worker's
gradient estimates the same full gradient, as in data-parallel training on shuffled shards; derived, no
guarantee on heterogeneous data), up to 2x (DCGD) and 6x (DIANA) larger when omega/n is large: the
worst case is safe but slow, start from the i.i.d. rule and tune. The
warning is given for the methods whose step bound carries the variance factor (DIANA, and method
``"none"`` around an unbiased compressor: DCGD), when the scale is below :data:`WARN_BELOW`, i.e.
when the optimizer's learning rate is more than that many times what theory allows *if* it was chosen
for uncompressed training. Not for EF21 (its theoretical step is conservative: the EF21 experiments
run multiples 1, 2, 4, ... of it, arXiv 2106.05203) nor for methods with no bound of this form (EF,
PowerSGD, DGC, the sign methods: :func:`~sparsecomm.theory.rates.step_scale` returns ``None``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

from sparsecomm.theory import rates

from ..errors import InvalidValueError
from ..methods import Method, Warmup

#: the scale below which the frontends warn (a learning rate 4x or more above theory's)
WARN_BELOW = 0.25
#: the size at which a compressor's constant is read when the sizes it compresses are unknown
PROBE_SIZE = 1 << 20


class StepSizeWarning(UserWarning):
    """Theory allows a much smaller step for this method than for uncompressed training
    (``warnings.filterwarnings("ignore", category=StepSizeWarning)`` silences it)."""


@dataclass(frozen=True)
class StepSizeHint:
    """What theory says about the step size of ``method`` (see the module doc)."""

    method: str
    #: ``"omega"`` (unbiased compressor), ``"delta"`` (contractive) or ``None``
    variance: str | None
    #: that constant, at the sizes the pipeline compresses
    factor: float | None
    #: the workers whose compression errors average out
    n_eff: int
    #: gamma L as a fraction of uncompressed gradient descent's 1/L, or ``None`` (no bound of this form)
    scale: float | None
    #: the bound, in words
    rule: str
    #: gamma L by the i.i.d.-data rule 1/(1 + omega/n) (DIANA, DCGD), else ``None``
    iid_scale: float | None = None

    def lr(self, base: float, rule: str = "worst-case") -> float | None:
        """The learning rate theory allows if ``base`` suits the same training uncompressed: by the
        worst-case bound (``rule="worst-case"``, the default) or the i.i.d.-data rule (``rule="iid"``;
        the worst case where the method has no such rule); see the module doc."""
        if rule not in rates.STEP_RULES:
            raise InvalidValueError(f"StepSizeHint.lr: rule must be one of {rates.STEP_RULES}, got {rule!r}")
        scale = self.iid_scale if rule == "iid" and self.iid_scale is not None else self.scale
        return None if scale is None else base * scale

    @property
    def warns(self) -> bool:
        """Whether the frontends warn: a variance-scaled step bound (DIANA, DCGD) below :data:`WARN_BELOW`."""
        return self.variance == "omega" and self.scale is not None and self.scale < WARN_BELOW

    def __str__(self) -> str:
        if self.scale is None:
            return f"method {self.method!r}: {self.rule}"
        iid = (f" (worst case; the i.i.d.-data rule 1/(1 + omega/n) allows {self.iid_scale:.3g} x)"
               if self.iid_scale is not None else "")
        return (f"method {self.method!r}: {self.variance} = {self.factor:.3g}, errors averaged over {self.n_eff} "
                f"worker(s): {self.rule} allows {self.scale:.3g} x the step of uncompressed training{iid}")


def hint(method: Method, world_size: int, sizes: Sequence[int] | None = None) -> StepSizeHint:
    """The :class:`StepSizeHint` of ``method`` run by ``world_size`` workers on compressed units
    (buckets, or parameters) of ``sizes`` elements (unknown: the constant at :data:`PROBE_SIZE`)."""
    while isinstance(method, Warmup):
        method = method.inner
    comp = method.compressor
    ds = [int(d) for d in (sizes or ()) if int(d) > 0] or [PROBE_SIZE]
    n_eff = 1 if comp.shared_randomness else max(1, int(world_size))
    name = method.name
    if name in ("diana", "none") and comp.unbiased:
        omega = max(float(comp.omega(d)) for d in ds)
        iid = rates.step_scale("dcgd", omega=omega, n=n_eff, rule="iid")
        if name == "diana":
            return StepSizeHint(name, "omega", omega, n_eff, rates.step_scale("diana", omega=omega, n=n_eff),
                                "DIANA's gamma <= 1/((1 + 6 omega/n) L_max) (Sadiev et al. 2022, Thm 2.2)", iid)
        return StepSizeHint(name, "omega", omega, n_eff, rates.step_scale("dcgd", omega=omega, n=n_eff),
                            "DCGD's gamma <= 1/(L + 2 omega L_max/n)", iid)
    delta = min(float(comp.delta(d)) for d in ds)
    if name == "ef21" and delta > 0:
        return StepSizeHint(name, "delta", delta, n_eff, rates.step_scale("ef21", delta=delta),
                            "EF21's gamma <= 1/(L + L_tilde sqrt(beta/theta)) (Richtarik et al. "
                            "2021; conservative in practice)")
    return StepSizeHint(name, "delta" if delta > 0 else None, delta if delta > 0 else None, n_eff, None,
                        "theory gives no step bound of the form c/L for it here: start from the step of "
                        "uncompressed training")


def check(h: StepSizeHint, lrs: Sequence[float], where: str, stacklevel: int = 3,
          base: float | None = None) -> None:
    """The frontends' one-line :class:`StepSizeWarning` when ``h.warns``. ``base``: the learning rate the
    user set (the inner optimizer's ``defaults["lr"]``), which the warning quotes with the value allowed;
    ``lrs``: the parameter groups' learning rates (groups at another rate are named, to scale alike);
    ``where``: how the user reads the hint."""
    if not h.warns:
        return
    groups = sorted({float(x) for x in lrs if _finite(x)})
    if not _finite(base):
        base = groups[-1] if groups else None
    if base is None:
        at = (f"scale a learning rate that suits uncompressed training by it ({where}.lr(lr); "
              f"{where}.lr(lr, rule='iid') by the i.i.d.-data rule)")
    else:
        base = float(base)
        at = (f"if lr={base:g} suits uncompressed training, use lr <= {h.lr(base):.3g} "
              f"({where}.lr({base:g}))" + (f", or lr <= {h.lr(base, 'iid'):.3g} by the i.i.d.-data rule "
                                           f"({where}.lr({base:g}, rule='iid'))" if h.iid_scale is not None else ""))
        others = [g for g in groups if g != base]
        if others:
            at += f"; parameter groups at lr={', '.join(f'{g:g}' for g in others)} scale by the same factor"
    warnings.warn(f"{h}; {at} (far above it training can stall or diverge)", StepSizeWarning,
                  stacklevel=stacklevel)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
