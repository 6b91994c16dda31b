"""Per-worker methods wrapping a compressor: none, ef, ef21, diana, dgc, powersgd, signsgd, signum, onebit.

Typed factories are the API; :data:`registry` is the one name -> factory catalog (for command lines
and configs), listed at the bottom of this file:

>>> import sparsecomm as sc
>>> sc.methods.diana(sc.compressors.randk(ratio=0.01), alpha=0.5)             # typed
Diana(compressor=RandK(ratio=0.01), alpha=0.5, init='zeros')
>>> sc.methods.get("diana", compressor="randk", ratio=0.01, alpha=0.5)        # by name (the catalog)
Diana(compressor=RandK(ratio=0.01), alpha=0.5, init='zeros')
>>> sc.methods.get("diana", ratio=0.01, levels=3)
Traceback (most recent call last):
    ...
sparsecomm.errors.HyperParameterError: compressor 'randk' does not take 'levels' (compressor 'randk' takes: ratio, k, independent; method 'diana' takes: compressor, alpha, init)

By name, the method's own keywords (its factory's parameters) go to the method and the others to its
compressor (a name, built from the compressor catalog); a keyword neither takes raises
:class:`~sparsecomm.errors.HyperParameterError` once, naming both parameter lists
(:meth:`sparsecomm.registry.Registry.check`). :func:`build` is the optimizer's and the DDP hook's
``compressor=`` / ``method=`` rule.

Wrappers compose: ``sc.methods.warmup(sc.methods.ef21(), steps=100)`` (the first 100 rounds exact).
A method holds hyper-parameters only; its state is explicit (:class:`~sparsecomm.methods.state.MethodState`:
``st = m.init(d, dtype, device)``, ``payload, st = m.encode(g, st, generator, world_size=n)``,
``estimate, st = m.decode(agg, n, st)``; :mod:`sparsecomm.methods.base`).

(As attributes of this package the names below are the factories; the modules of the same names stay
importable as ``sparsecomm.methods.<name>`` with ``from ... import``.)
"""

from __future__ import annotations

from typing import Any

from sparsecomm.theory import compressors as th

from .. import compressors
from ..compressors.base import Compressor
from ..deprecation import warn_renamed
from ..errors import HyperParameterError, InvalidTypeError, UnknownNameError
from ._registry import registry
from .base import Method, MethodState
from .warmup import Warmup, warmup
from .dgc import DGC
from .diana import Diana
from .ef import ErrorFeedback
from .ef21 import EF21
from .none import NoMethod
from .onebit import OneBitSGD
from .powersgd import PowerSGD
from .signsgd import SignSGD
from .signum import Signum


# ---------------------------------------------------------------------------- typed factories
def none(compressor: Compressor | None = None) -> NoMethod:
    """No memory: ``C(g)`` averaged (default compressor: the identity, i.e. plain averaging).

    Args:
        compressor: the compressor (default: the identity).
    """
    return NoMethod(compressor)


def ef(compressor: Compressor | None = None) -> ErrorFeedback:
    """Error feedback around ``compressor`` (default: top-k, ratio 0.01)."""
    return ErrorFeedback(compressor)


def ef21(compressor: Compressor | None = None, *, init: str = "grad") -> EF21:
    """EF21 around a contractive ``compressor`` (default: top-k, ratio 0.01); ``init`` "grad" or "zeros"."""
    return EF21(compressor, init=init)


def diana(compressor: Compressor | None = None, *, alpha: float | None = None, init: str = "zeros") -> Diana:
    """DIANA around an unbiased ``compressor`` (default: shared-seed rand-k, ratio 0.01); ``alpha``
    defaults to 1/(omega+1).

    Args:
        compressor: an unbiased compressor.
        alpha: the shifts' step (default 1/(omega+1)).
        init: ``"zeros"`` (shifts start at 0) or ``"grad"`` (the first round is exact and sets them).
    """
    return Diana(compressor, alpha=alpha, init=init)


def dgc(ratio: float = th.DGC_RATIO, *, momentum: float = th.DGC_MOMENTUM,
        sample_ratio: float = th.DGC_SAMPLE_RATIO, warmup_steps: int = 0, clip_norm: float | None = None) -> DGC:
    """Deep Gradient Compression (its own sampled top-k).

    Args:
        ratio: the kept fraction after warm-up.
        momentum: the momentum of the correction.
        sample_ratio: the share of entries sampled to estimate the threshold.
        warmup_steps: steps of the sparsity warm-up (four stages).
        clip_norm: the local gradient clipping norm (``None``: none).
    """
    return DGC(ratio, momentum=momentum, sample_ratio=sample_ratio, warmup_steps=warmup_steps,
               clip_norm=clip_norm)


def powersgd(matrix_approximation_rank: int = 1, *, start_powerSGD_iter: int = 0,
             min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
             rank: int | None = None, start_iter: int | None = None,
             error_feedback: bool | None = None, orthogonalization_epsilon: float = 0.0,
             batch_tensors_with_same_shape: bool = False,
             compression_stats_logging_frequency: int = 10_000, random_seed: int | None = None) -> PowerSGD:
    """PowerSGD (two rounds per step) with the keywords of torch's ``PowerSGDState``, so that
    ``powerSGD_hook`` moves over by name: ``matrix_approximation_rank``, ``start_powerSGD_iter`` (the
    frontend's steps ``0 .. start_powerSGD_iter - 1`` are averaged uncompressed), ``min_compression_rate``,
    ``use_error_feedback``, ``warm_start``, ``orthogonalization_epsilon``, ``batch_tensors_with_same_shape``,
    ``compression_stats_logging_frequency`` (these three change no number), ``random_seed`` (the starting Qs
    as torch's hook draws them; without it the frontend's ``seed=``: :mod:`sparsecomm.methods.powersgd`). ``rank``, ``start_iter`` and ``error_feedback`` are
    deprecated aliases (a :class:`FutureWarning`; ``rank`` read as the process rank)."""
    values = {"matrix_approximation_rank": matrix_approximation_rank, "start_powerSGD_iter": start_powerSGD_iter,
              "use_error_feedback": use_error_feedback}
    defaults = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 0, "use_error_feedback": True}
    for old, new, alias in (("rank", "matrix_approximation_rank", rank),
                            ("start_iter", "start_powerSGD_iter", start_iter),
                            ("error_feedback", "use_error_feedback", error_feedback)):
        if alias is None:
            continue
        if values[new] not in (defaults[new], alias):
            raise HyperParameterError(f"powersgd: {old}={alias!r} and {new}={values[new]!r} given; {old} is the "
                                      f"deprecated name of {new}: pass {new} only")
        warn_renamed(f"powersgd's {old}=", f"{new}=")
        values[new] = alias
    return PowerSGD(**values, min_compression_rate=min_compression_rate, warm_start=warm_start,
                    orthogonalization_epsilon=orthogonalization_epsilon,
                    batch_tensors_with_same_shape=batch_tensors_with_same_shape,
                    compression_stats_logging_frequency=compression_stats_logging_frequency,
                    random_seed=random_seed)


def signsgd() -> SignSGD:
    """signSGD with majority vote."""
    return SignSGD()


def signum(beta: float = 0.9) -> Signum:
    """Signum: the sign of the momentum, majority vote.

    Args:
        beta: the momentum's decay.
    """
    return Signum(beta)


def onebit(bucket_size: int | None = 512, *, levels: str = "two") -> OneBitSGD:
    """1-bit SGD with error feedback (``levels`` "two" or "symmetric").

    Args:
        bucket_size: entries per pair of levels (``None``: the whole bucket).
        levels: ``"two"`` (the means of each sign) or ``"symmetric"`` (one level).
    """
    return OneBitSGD(bucket_size, levels=levels)


# ---------------------------------------------------------------------------- the catalog
for _name, _factory, _cls in (
        ("none", none, NoMethod), ("ef", ef, ErrorFeedback), ("ef21", ef21, EF21), ("diana", diana, Diana),
        ("dgc", dgc, DGC), ("powersgd", powersgd, PowerSGD), ("signsgd", signsgd, SignSGD),
        ("signum", signum, Signum), ("onebit", onebit, OneBitSGD)):
    registry.register(_name, product=_cls)(_factory)
del _name, _factory, _cls


def available() -> list[str]:
    """The registered methods (``compressor=`` of the optimizer and the DDP hook takes these names as
    well as the compressors': :func:`compressor_choices` lists both)."""
    return registry.available()


def compressor_choices() -> dict[str, list[str]]:
    """Every name ``compressor=`` of :class:`~sparsecomm.DistributedOptimizer` and of the DDP hook
    accepts (:func:`build`): ``{"methods": [...], "compressors": [...]}``. A method name builds that
    method with its default compressor; a compressor name builds method ``method=`` (``"none"`` by
    default) around it (``sc.compressors.available()`` lists only the compressors)."""
    return {"methods": available(), "compressors": compressors.available()}


def wraps_compressor(name: str) -> bool:
    """Whether method ``name`` takes a compressor (the others bring their own operator)."""
    return "compressor" in (registry.parameters(name) or ())


def get(name: str, **hyper: Any) -> Method:
    """Build the method ``name`` from the catalog: its own keywords go to it, the others (and
    ``compressor=``, a name or a Compressor) to its compressor; an unknown name raises listing the
    valid ones, a keyword nothing takes names both parameter lists.

    Args:
        name: a name of :func:`available`.
        **hyper: the method's keywords, the others (and ``compressor=``) its compressor's.
    """
    factory = registry.factory(name)
    if not wraps_compressor(name):
        registry.check(name, hyper)
        return factory(**hyper)
    own = registry.parameters(name) or []
    comp = hyper.pop("compressor", None)
    mine = {k: hyper.pop(k) for k in list(hyper) if k in own}
    if isinstance(comp, Compressor) or (comp is not None and not isinstance(comp, str)):
        if hyper:
            raise InvalidTypeError(f"method {name!r}: hyper-parameters {sorted(hyper)} given with a compressor "
                                   f"object {comp!r}; pass them to the compressor instead")
    else:
        cls = registry.product(name)
        cname = comp if comp is not None else cls.default_compressor
        if comp is None and not hyper:
            hyper = dict(cls.default_compressor_hyper)
        compressors.registry.check(cname, hyper, also={f"method {name!r}": own})
        comp = compressors.get(cname, **hyper)
    return factory(comp, **mine)


def build(compressor: str | Compressor | None = None, method: str | Method | None = None, **hyper: Any) -> Method:
    """The method that ``DistributedOptimizer(inner, compressor=..., method=..., **hyper)`` (and the DDP
    hook) runs. ``compressor=`` takes compressors, ``method=`` methods:

    - ``method``: a Method object (as given: its compressor and hyper-parameters are its own), or a
      method name (default ``"none"``) built with ``hyper`` around ``compressor`` (its default
      compressor when ``compressor`` is ``None``);
    - ``compressor``: a Compressor object, or a compressor name built with ``hyper``;
    - the flat form of command lines and configs: ``compressor=<method name>`` (``method`` not given)
      builds that method with its default compressor, ``hyper`` routed as :func:`get` routes it
      (``compressor="diana", ratio=0.01``).

    A Method object given as ``compressor=`` still works, with a :class:`FutureWarning` naming
    ``method=``."""
    if isinstance(compressor, Method):
        if method is not None:
            raise InvalidTypeError(f"compressor={compressor!r} is a Method object and method={method!r} was given "
                                   f"too; pass the method object alone, as method=")
        warn_renamed("compressor=<a Method object>", "method=<the Method object>", stacklevel=5)
        compressor, method = None, compressor
    if isinstance(method, Method):
        if compressor is not None or hyper:
            raise InvalidTypeError(f"a Method object ({method!r}) was given; its compressor and hyper-parameters "
                                   f"{sorted(hyper)} belong to its constructor")
        return method
    if method is not None and not isinstance(method, str):
        raise InvalidTypeError(f"method must be a method name or a Method, got {method!r}")
    if isinstance(compressor, str) and compressor in registry:
        if method is not None:
            raise InvalidTypeError(f"compressor={compressor!r} is a method; to pick its compressor use "
                                   f"compressor=<compressor name>, method={compressor!r}")
        return get(compressor, **hyper)
    if isinstance(compressor, str) and compressor not in compressors.registry:
        raise UnknownNameError(f"unknown compressor or method {compressor!r}; methods: {', '.join(available())}; "
                               f"compressors: {', '.join(compressors.available())} "
                               f"(sparsecomm.methods.compressor_choices() lists both)")
    if compressor is not None and not isinstance(compressor, (str, Compressor)):
        raise InvalidTypeError(f"compressor must be a compressor name or a Compressor (a method goes to method=), "
                               f"got {compressor!r}")
    mname = method or "none"
    registry.factory(mname)  # unknown method names raise, listing the valid ones
    if compressor is None:
        return get(mname, **hyper)
    if not wraps_compressor(mname):
        raise HyperParameterError(f"method {mname!r} brings its own operator and takes no compressor; "
                                  f"use compressor={mname!r} (with its own hyper-parameters)")
    return get(mname, compressor=compressor, **hyper)


__all__ = ["Method", "MethodState", "Warmup", "warmup", "get", "build", "available", "compressor_choices",
           "registry", "wraps_compressor", "none", "ef", "ef21", "diana", "dgc", "powersgd", "signsgd", "signum",
           "onebit"]
