"""Per-worker methods wrapping a compressor: none, ef, ef21, diana, dgc, powersgd, signsgd, signum, onebit.

Typed factories are the API; the registry is the one name -> factory catalog (for command lines and
configs)::

    m = sc.methods.diana(sc.compressors.get("randk", ratio=0.01), alpha=0.5)   # typed
    m = sc.methods.get("diana", compressor="randk", ratio=0.01)                # by name (the catalog)

Wrappers compose: ``sc.methods.warmup(sc.methods.ef21(), steps=100)`` (the first 100 rounds exact).
A method holds hyper-parameters only; its state is explicit (:class:`~sparsecomm.methods.base.MethodState`:
``st = m.init(d)``, ``payload, st = m.encode(g, st, generator)``, ``estimate, st = m.decode(agg, n, st)``).
"""

from __future__ import annotations

from ..compressors.base import Compressor
from ._registry import registry


def get(name: str, **hyper):
    """Build the method ``name`` from the catalog; an unknown name raises listing the valid ones."""
    return registry.get(name, **hyper)


def available() -> list[str]:
    return registry.available()


from . import _load  # noqa: E402,F401  (every module registers its classes)
from .base import Method, MethodState  # noqa: E402
from .warmup import Warmup, warmup  # noqa: E402
from .dgc import DGC  # noqa: E402
from .diana import Diana  # noqa: E402
from .ef import ErrorFeedback  # noqa: E402
from .ef21 import EF21  # noqa: E402
from .none import NoMethod  # noqa: E402
from .onebit import OneBitSGD  # noqa: E402
from .powersgd import PowerSGD  # noqa: E402
from .signsgd import SignSGD  # noqa: E402
from .signum import Signum  # noqa: E402


# ---------------------------------------------------------------- typed factories (the modules of the same
# names stay importable as ``sparsecomm.methods.<name>`` through ``import``; as attributes these names are
# the factories)
def none(compressor: Compressor | str | None = None, **compressor_hyper) -> NoMethod:
    """No memory: ``C(g)`` averaged (default compressor: the identity, i.e. plain averaging)."""
    return NoMethod(compressor, **compressor_hyper)


def ef(compressor: Compressor | str | None = None, **compressor_hyper) -> ErrorFeedback:
    """Error feedback around ``compressor`` (default: top-k, ratio 0.01)."""
    return ErrorFeedback(compressor, **compressor_hyper)


def ef21(compressor: Compressor | str | None = None, *, init: str = "grad", **compressor_hyper) -> EF21:
    """EF21 around a contractive ``compressor`` (default: top-k, ratio 0.01); ``init`` "grad" or "zeros"."""
    return EF21(compressor, init=init, **compressor_hyper)


def diana(compressor: Compressor | str | None = None, *, alpha: float | None = None, init: str = "zeros",
          **compressor_hyper) -> Diana:
    """DIANA around an unbiased ``compressor`` (default: shared-seed rand-k, ratio 0.01); ``alpha``
    defaults to 1/(omega+1)."""
    return Diana(compressor, alpha=alpha, init=init, **compressor_hyper)


def dgc(ratio: float | None = None, **hyper) -> DGC:
    """Deep Gradient Compression (its own sampled top-k): ``ratio``, ``momentum``, ``sample_ratio``,
    ``warmup_steps``, ``clip_norm``."""
    return DGC(**({} if ratio is None else {"ratio": ratio}), **hyper)


def powersgd(rank: int = 1, **hyper) -> PowerSGD:
    """PowerSGD of ``rank`` (two rounds per step): ``min_compression_rate``, ``start_iter``,
    ``error_feedback``, ``warm_start``."""
    return PowerSGD(rank, **hyper)


def signsgd() -> SignSGD:
    """signSGD with majority vote."""
    return SignSGD()


def signum(beta: float = 0.9) -> Signum:
    """Signum: the sign of the momentum, majority vote."""
    return Signum(beta)


def onebit(bucket_size: int | None = 512, *, levels: str = "two") -> OneBitSGD:
    """1-bit SGD with error feedback (``levels`` "two" or "symmetric")."""
    return OneBitSGD(bucket_size, levels=levels)

