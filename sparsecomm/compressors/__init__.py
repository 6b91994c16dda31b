"""Stateless compression operators: ``C(x, generator) -> Payload``, randomness only from the generator
handed in (an operator holds none).

Typed factories are the API; :data:`registry` is the one name -> factory catalog (for command lines and
configs), listed at the bottom of this file:

>>> import sparsecomm as sc
>>> sc.compressors.randk(ratio=0.01)                  # typed
RandK(ratio=0.01)
>>> sc.compressors.get("randk", ratio=0.01)           # by name (the catalog)
RandK(ratio=0.01)
>>> sc.compressors.compose(sc.compressors.randk(ratio=0.5), sc.compressors.natural()).omega(1000)
1.25

A keyword a factory does not take, given by name, raises
:class:`~sparsecomm.errors.HyperParameterError` naming the ones it takes. Adding a compressor: one
module (its class, one paper) plus a typed factory and its catalog line here.

(As attributes of this package the names below are the factories; the modules of the same names stay
importable as ``sparsecomm.compressors.<name>`` with ``from ... import``.)
"""

from __future__ import annotations

from ._registry import registry
from .base import Compressor
from .compose import Composed, Induced
from .compose import compose as _compose_by_name, induced as _induced_by_name
from .identity import BF16, FP16, Identity
from .natural import Natural, NaturalDithering
from .qsgd import QSGD
from .randk import RandK
from .sign import ScaledSign
from .terngrad import TernGrad
from .topk import Threshold, TopK


def get(name: str, **hyper) -> Compressor:
    """Build the compressor ``name`` from the catalog; an unknown name raises listing the valid ones.

    Args:
        name: a name of :func:`available`.
        **hyper: the keywords of its factory (``ratio=0.01``).
    """
    return registry.get(name, **hyper)


def available() -> list[str]:
    """The registered compressors. ``compressor=`` of the optimizer and the DDP hook also takes method
    names (``sc.methods.available()``; ``sc.methods.compressor_choices()`` lists both)."""
    return registry.available()


# ---------------------------------------------------------------------------- typed factories
def identity() -> Identity:
    """No compression (dense payload): plain averaging."""
    return Identity()


#: ``sc.compressors.none()`` is the identity (the *method* named ``"none"`` is plain averaging of C(g))
none = identity


def fp16(*, underflow: str = "count") -> FP16:
    """Cast to float16; ``underflow`` "count" (counted in the statistics), "raise" (delta holds on every
    call) or "allow"."""
    return FP16(underflow)


def bf16(*, underflow: str = "count") -> BF16:
    """Cast to bfloat16; ``underflow`` "count", "raise" or "allow"."""
    return BF16(underflow)


def topk(ratio: float | None = None, *, k: int | None = None) -> TopK:
    """The ``k`` (or ``ratio * d``) largest entries in magnitude; contractive, ``sparse`` payload."""
    return TopK(ratio, k)


def threshold(threshold: float | None = None) -> Threshold:
    """The entries with ``|x_i| >= threshold``."""
    return Threshold(threshold)


def randk(ratio: float | None = None, *, k: int | None = None, independent: bool = False) -> RandK:
    """Rand-k scaled by d/k (unbiased); shared-seed positions (``aligned``) unless ``independent``.

    Args:
        ratio: the kept fraction of the coordinates, k = ceil(ratio d).
        k: a fixed number of coordinates instead of ``ratio``.
        independent: per-worker positions (a ``sparse`` payload) instead of shared-seed ones.
    """
    return RandK(ratio, k, independent)


def qsgd(levels: int = 4, *, bucket_size: int | None = None) -> QSGD:
    """QSGD with ``levels`` levels per bucket of ``bucket_size`` entries (``None``: the whole vector)."""
    return QSGD(levels, bucket_size)


def terngrad(*, bucket_size: int | None = None) -> TernGrad:
    """TernGrad: codes in {-1, 0, 1} times each bucket's max.

    Args:
        bucket_size: entries per max-norm (``None``: the whole vector).
    """
    return TernGrad(bucket_size)


def natural() -> Natural:
    """Natural compression: random rounding to a signed power of two (omega = 1/8)."""
    return Natural()


def natural_dithering(levels: int = 4, *, bucket_size: int | None = None, p: float = 2) -> NaturalDithering:
    """Natural dithering with ``levels`` levels and the ``p`` norm (2 or inf).

    Args:
        levels: the number of levels.
        bucket_size: entries per norm (``None``: the whole vector).
        p: the norm: 2 or ``inf``.
    """
    return NaturalDithering(levels, bucket_size, p)


def sign() -> ScaledSign:
    """The sign scaled by ||x||_1 / d (biased, contractive)."""
    return ScaledSign()


def compose(first: Compressor, second: Compressor) -> Composed:
    """``second(first(x))`` for two unbiased operators (``sc.compressors.compose(randk(ratio=0.01),
    natural())``)."""
    return _compose_by_name(first, second)


def induced(first: Compressor, second: Compressor) -> Induced:
    """``first(x) + second(x - first(x))``: the compressor induced by a contractive ``first``."""
    return _induced_by_name(first, second)


# ---------------------------------------------------------------------------- the catalog
# name -> typed factory (and the class it builds, whose traits are read without building one); the
# compositions by name take the parts as names with their keywords (``get("compose", first="randk",
# second="natural", ratio=0.01)``, see :mod:`sparsecomm.compressors.compose`)
for _name, _factory, _cls in (
        ("identity", identity, Identity), ("fp16", fp16, FP16), ("bf16", bf16, BF16),
        ("topk", topk, TopK), ("threshold", threshold, Threshold), ("randk", randk, RandK),
        ("qsgd", qsgd, QSGD), ("terngrad", terngrad, TernGrad), ("natural", natural, Natural),
        ("natural_dithering", natural_dithering, NaturalDithering), ("sign", sign, ScaledSign),
        ("compose", _compose_by_name, Composed), ("induced", _induced_by_name, Induced)):
    registry.register(_name, product=_cls)(_factory)
del _name, _factory, _cls

__all__ = ["Compressor", "get", "available", "registry", "identity", "none", "fp16", "bf16", "topk",
           "threshold", "randk", "qsgd", "terngrad", "natural", "natural_dithering", "sign", "compose",
           "induced"]
