"""One run's configuration, its validation against the library's registries, and its stable key.

A :class:`RunConfig` names a task, a compressor, a method and a transport (each a registered name,
with hyper-parameters), the workers and the network. :func:`validate` builds the method and looks the
transport up exactly as :class:`sparsecomm.DistributedOptimizer` will, with the library's own checks
(:func:`sparsecomm.methods.build`, :func:`sparsecomm.pipeline.resolve.check_pair`), so an unknown name or an
invalid compressor x transport pair fails before any run starts, with the library's message.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import sparsecomm as sc
from sparsecomm.errors import ConfigError, IncompatibleError, UnknownNameError
from sparsecomm.registry import parameters

from . import tasks

#: ``sim``: threads over a SimFabric (modelled network); ``gloo``: torch.distributed processes
BACKENDS = ("sim", "gloo")
#: other names of compressors on the command line: ``none`` (Python's flat ``compressor="none"``, plain
#: averaging) is the ``identity`` compressor, the one name the studies print and record
COMPRESSOR_ALIASES = {"none": "identity"}


def compressor_name(name: str) -> str:
    """The compressor's one name (:data:`COMPRESSOR_ALIASES` resolved)."""
    return COMPRESSOR_ALIASES.get(name, name) if isinstance(name, str) else name


@dataclass
class RunConfig:
    """Everything that determines a run. ``None`` task defaults are filled by :meth:`resolved`."""

    #: a bundled task's name, or ``module:attr`` naming a researcher's ``build(seed) -> TaskSpec``
    task: str = "recsys-zipf"
    compressor: str = "identity"
    method: str = "none"
    transport: str = "ring"
    compressor_kw: dict[str, Any] = field(default_factory=dict)
    method_kw: dict[str, Any] = field(default_factory=dict)
    transport_kw: dict[str, Any] = field(default_factory=dict)
    #: block size of the block-sparsity measurement; also given to transports that take ``block_size``
    block_size: int = 256
    workers: int = 8
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    warmup_steps: int = 0
    seed: int = 0
    eval_every: int = 10
    backend: str = "sim"
    bandwidth_gbps: float = 100.0
    latency_us: float = 2.0
    loss: float = 0.0

    # ----------------------------------------------------------------- derived
    def resolved(self) -> "RunConfig":
        """A copy with the task's defaults filled in for ``steps``, ``batch_size`` and ``lr`` (and the
        compressor's alias resolved: :data:`COMPRESSOR_ALIASES`)."""
        steps, batch_size, lr = tasks.defaults(self.task, self.seed)
        return replace(self, compressor=compressor_name(self.compressor),
                       steps=self.steps if self.steps is not None else steps,
                       batch_size=self.batch_size if self.batch_size is not None else batch_size,
                       lr=self.lr if self.lr is not None else lr)

    def transport_kwargs(self) -> dict[str, Any]:
        """``transport_kw`` plus ``block_size`` when the transport takes one."""
        kw = dict(self.transport_kw)
        if "block_size" not in kw and accepts(sc.transports.registry.factory(self.transport), "block_size"):
            kw["block_size"] = self.block_size
        return kw

    @property
    def scheme(self) -> str:
        """A short label of the compression scheme, e.g. ``ef+topk(ratio=0.01)`` or ``none``."""
        comp = self.compressor + _kw_label(self.compressor_kw)
        if self.method == "none":
            return "none" if self.compressor == "identity" and not self.compressor_kw else comp
        return f"{self.method}{_kw_label(self.method_kw)}+{comp}"

    @property
    def label(self) -> str:
        return f"{self.scheme} / {self.transport}"

    @property
    def stem(self) -> str:
        """The run as a file name: ``recsys-zipf_ef-topk-ratio-0.01_omnireduce_n8_s0``."""
        return "_".join([slug(tasks.display_name(self.task, self.seed)), slug(self.scheme), self.transport,
                         f"n{self.workers}", f"s{self.seed}"])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str:
        """A stable hash of the configuration (the resumable grid's cell id)."""
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def slug(text: str) -> str:
    """``text`` as part of a file name: runs of anything but letters, digits and ``.`` become one ``-``
    (``ef+topk(ratio=0.01)`` -> ``ef-topk-ratio-0.01``)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def _kw_label(kw: dict[str, Any]) -> str:
    return "(" + ",".join(f"{k}={v}" for k, v in sorted(kw.items())) + ")" if kw else ""


def accepts(factory: Any, name: str) -> bool:
    """Whether ``factory`` takes the keyword argument ``name`` (used to apply an ablation axis)."""
    params = parameters(factory)
    return params is None or name in params


# ------------------------------------------------------------------------------- validation
def check_compatible(cfg: RunConfig) -> None:
    """Raise the library's own error if ``cfg``'s compressor/method/transport cannot run together.

    :class:`~sparsecomm.errors.UnknownNameError` for an unknown name (listing the valid ones),
    :class:`~sparsecomm.errors.IncompatibleError` for an invalid pair (e.g. DIANA needs an unbiased
    compressor; top-k's sparse payload on ``ring``), ``TypeError`` for a hyper-parameter a component
    does not take.
    """
    from sparsecomm.pipeline.resolve import check_pair

    method = sc.methods.build(cfg.compressor, cfg.method, **cfg.compressor_kw, **cfg.method_kw)
    tcls = sc.transports.registry.factory(cfg.transport)
    check_pair(method, cfg.transport, tcls)
    kw = cfg.transport_kwargs()
    sc.transports.registry.check(cfg.transport, kw)   # a keyword it does not take raises, naming its own
    if cfg.backend == "sim":
        _trial_transport(cfg.transport, json.dumps(kw, sort_keys=True, default=str), int(cfg.workers))


@functools.lru_cache(maxsize=64)
def _trial_transport(name: str, kw_json: str, workers: int) -> None:
    """Build the transport once on a throwaway SimFabric of ``workers`` endpoints, so that its own
    checks of its hyper-parameters and of the world size run before any study starts. (On real
    fabrics the same checks run when the workers build it.)"""
    from sparsecomm.fabric.sim.sim import SimWorld

    world = SimWorld(workers)
    try:
        sc.transports.get(name, world.fabric(0), **json.loads(kw_json))
    finally:
        world.close()


def validate(cfg: RunConfig) -> RunConfig:
    """Check every name and setting of ``cfg`` (raising a clear error) and return it resolved."""
    tasks.check(cfg.task, cfg.seed)  # an unknown name, or a researcher's task that does not build, raises
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {cfg.backend!r}; valid: {', '.join(BACKENDS)}")
    for name in ("workers", "block_size", "eval_every"):
        if int(getattr(cfg, name)) < 1:
            raise ConfigError(f"{name} must be a positive integer, got {getattr(cfg, name)!r}")
    cfg = cfg.resolved()
    if cfg.steps < 1 or cfg.batch_size < 1 or not cfg.lr > 0:
        raise ConfigError(f"steps, batch_size and lr must be positive (got {cfg.steps}, {cfg.batch_size}, "
                          f"{cfg.lr})")
    _library_checks(cfg)
    return cfg


def _library_checks(cfg: RunConfig) -> None:
    try:
        sc.Network(bandwidth_gbps=cfg.bandwidth_gbps, latency_us=cfg.latency_us, loss=cfg.loss)
        check_compatible(cfg)
    except (IncompatibleError, UnknownNameError):
        raise
    except (TypeError, ValueError) as e:  # a bad hyper-parameter or network setting: say which run
        raise ConfigError(f"{cfg.label}: {e}") from None


#: what a study catches before running anything, to exit with one clear message
INVALID = (ConfigError, UnknownNameError, IncompatibleError)


def incompatibility(cfg: RunConfig) -> str | None:
    """The library's reason why ``cfg``'s compressor x transport pair cannot run, or ``None``.

    Only :class:`IncompatibleError` counts: unknown names and bad settings still raise.
    """
    try:
        _library_checks(cfg)
    except IncompatibleError as e:
        return str(e)
    return None


def parse_kv(items: list[str] | None) -> dict[str, Any]:
    """``["ratio=0.01", "init=grad"]`` -> ``{"ratio": 0.01, "init": "grad"}`` (numbers, bools parsed)."""
    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"expected KEY=VALUE, got {item!r}")
        out[k.strip().replace("-", "_")] = parse_value(v.strip())
    return out


def parse_value(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


__all__ = ["RunConfig", "ConfigError", "INVALID", "validate", "check_compatible", "incompatibility", "parse_kv",
           "UnknownNameError", "IncompatibleError", "accepts"]
