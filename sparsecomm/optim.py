"""DistributedOptimizer: buckets -> method -> transport -> averaged gradient -> inner step.

>>> def fn(ctx):                                                     # doctest: +SKIP
...     model = make_model()
...     opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
...                                   compressor="diana", transport="omnireduce", ratio=0.01)
...     for x, y in data(ctx.rank):
...         opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
>>> sc.launch(fn, world_size=4, backend="sim")                      # doctest: +SKIP

**Wrapping.** As Horovod does, ``DistributedOptimizer(inner, ...)`` returns an instance of a dynamic
subclass of ``type(inner)`` (and of :class:`DistributedOptimizer`) that *shares* the inner optimizer's
``param_groups``, ``state`` and ``defaults`` (no re-construction, so optimizers with required
arguments and existing state are fine). ``isinstance(opt, torch.optim.SGD)`` holds, LR schedulers
work (created before or after wrapping: the ``param_groups`` list is the same object), step hooks
registered on the inner optimizer still run. After wrapping, use the returned object only.

**Step.** ``step()`` first synchronises the gradients (unless :meth:`synchronize` was called since
the last step: the gradient-clipping pattern ``opt.synchronize(); clip_grad_norm_(...); opt.step()``),
then runs the inner step. Synchronising: the parameters that require grad are laid out in
``param_groups`` order into flat buckets of at most ``bucket_cap_mb`` MiB (one dtype/device per
bucket; a larger tensor gets a bucket of its own); each bucket goes
``method.encode -> transport.allreduce -> method.decode`` and ``p.grad`` becomes a view of the
bucket's averaged estimate (as DDP's ``gradient_as_bucket_view``: no copy; the buffers are reused, so
a gradient kept past the next step is overwritten). The layout depends only on the parameters, so it is identical on every worker and
stable across steps; bucket ``i`` is the method-state key ``i``. A parameter whose ``grad`` is
``None`` on a worker contributes zeros; after synchronising, every parameter in the layout has the
averaged gradient (zeros where no worker had one), so all workers stay identical. With a
``closure``, every evaluation of the closure is synchronised (the closure must run the same number of
times on every worker, which holds for SGD/Adam-style optimizers).

**Compressor / method.** ``compressor=`` is a method name (``sc.methods.available()``: builds that
method with its default compressor), a compressor name (``sc.compressors.available()``: builds method
``method=`` around it, ``"none"`` by default), a ``Compressor`` or a ``Method`` object. Further
keyword arguments are hyper-parameters of the method/compressor::

    DistributedOptimizer(inner, compressor="topk", ratio=0.01)                 # none + top-k
    DistributedOptimizer(inner, compressor="topk", method="ef", ratio=0.01)    # EF + top-k
    DistributedOptimizer(inner, compressor="diana", ratio=0.01, alpha=0.05)    # DIANA + rand-k
    DistributedOptimizer(inner, compressor=sc.methods.get("ef21", compressor="topk", ratio=0.01))

``transport=`` is a transport name (hyper-parameters in ``transport_kwargs=``; a transport that
takes ``inplace`` gets ``inplace=True`` unless told otherwise, since the buckets are scratch), a
``Transport`` object, or ``"auto"`` (the first of ring, omnireduce, switch, allgather that carries the payload;
``native`` for dense payloads on a torch.distributed fabric; allgather first for scattered ``sparse``
payloads such as top-k, and for natural compression while ``n < 64/9``, where it ships fewer bytes:
see :func:`sparsecomm.pipeline._auto_transport`). An invalid compressor x transport pair
(top-k's worker-specific indices on ``ring``) raises :class:`~sparsecomm.errors.IncompatibleError`
at construction, naming the pair, the transports that would carry it and the compressors the
transport would carry. ``fabric=`` defaults to the one :func:`sparsecomm.launch` set up
(:func:`sparsecomm.launch.current_context`), else a ``TorchFabric`` over an initialised default
process group.

**Researcher options.** ``warmup_steps`` (default 0): the first steps communicate uncompressed
(*exact* rounds of the method, which warm-start its state: see :mod:`sparsecomm.methods.base`).
``min_compress_size`` (default 0): parameters with fewer elements go to separate buckets that are
always averaged uncompressed, bypassing the method. ``seed``: one ``torch.Generator`` per worker for
the compressor, seeded ``seed`` on every worker when the compressor declares ``shared_randomness``
(so shared-seed rand-k draws the same coordinates everywhere and advances identically), else
``seed + rank``.

**Logging.** ``last_stats``: the last synchronisation's :class:`~sparsecomm.fabric.stats.CommStats`
summed over buckets (bytes, messages; modelled time on SimFabric). :meth:`compression_stats`:
cumulative bytes before (dense) and after (declared payload bits) compression and their ratio, next to
the bytes the transport's ledger counted (``bytes_sent``), what it would count if payloads travelled as
declared (``bytes_declared_sent``), their quotient ``sent_over_declared`` and the compression ratio
measured on the wire (``ratio_sent``); see :class:`~sparsecomm.pipeline.CompressionStats`.

**Checkpoints.** ``state_dict()`` is the inner optimizer's plus a ``"sparsecomm"`` entry: the method
state (per worker: EF residuals, DIANA's h_i), the step counter, the generator state, the bucket
layout, rank and world size; never a fabric or process group. Every rank saves its own. Loading a
state saved with another world size or rank, or another layout, raises
:class:`~sparsecomm.errors.MismatchError`; delete the ``"sparsecomm"`` entry to load only the inner
optimizer's state (the method then starts afresh, as DeepSpeed does for its error feedback).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .compressors.base import Compressor
from .errors import MismatchError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import HyperParameterError, Method
# the pipeline's builders, re-exported: ``sparsecomm.optim.check_pair`` etc. are documented names
from .pipeline import (AUTO_ORDER, CommPipeline, CompressionStats, build_method, build_transport,
                       check_pair, default_fabric)
from .transports.base import Transport

__all__ = ["DistributedOptimizer", "AUTO_ORDER", "CompressionStats", "build_method", "build_transport",
           "check_pair", "default_fabric"]

# ============================================================================ buckets
@dataclass
class _Bucket:
    key: int
    params: list[torch.nn.Parameter]
    dtype: torch.dtype
    device: torch.device
    compress: bool
    numel: int = 0
    offsets: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        buf = self.buffer
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            view = buf[off:off + n]
            g = p.grad
            if g is None:
                view.zero_()
            else:
                if g.is_sparse:
                    g = g.to_dense()
                view.copy_(g.reshape(-1))
        return buf

    def scatter(self, est: torch.Tensor) -> None:
        """``p.grad`` becomes a view of ``est`` (a fresh tensor every step: no copy), as DDP's
        ``gradient_as_bucket_view``."""
        same = est.dtype == self.dtype and est.device == self.device
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            v = est[off:off + n].view_as(p)
            p.grad = v if same else v.to(device=p.device, dtype=p.dtype)


def _layout(params: list[torch.nn.Parameter], cap_bytes: int, min_compress_size: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    open_: dict[tuple, _Bucket] = {}
    for p in params:
        compress = p.numel() >= min_compress_size
        sig = (p.dtype, p.device, compress)
        b = open_.get(sig)
        nbytes = p.numel() * p.element_size()
        if b is not None and b.numel and (b.numel * p.element_size() + nbytes) > cap_bytes:
            b = None
        if b is None:
            b = _Bucket(len(buckets), [], p.dtype, p.device, compress)
            buckets.append(b)
            open_[sig] = b
        b.offsets.append(b.numel)
        b.params.append(p)
        b.numel += p.numel()
    return buckets


# ============================================================================ the optimizer
_CLASSES: dict[type, type] = {}


class DistributedOptimizer:
    """Wrap a torch optimizer so that ``step()`` averages (compressed) gradients first; see the module doc.

    ``DistributedOptimizer(inner, compressor="none", transport="auto", *, method=None,
    transport_kwargs=None, fabric=None, bucket_cap_mb=25, warmup_steps=0, min_compress_size=0,
    seed=0, **hyper)``
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer)!r}")
        base = type(optimizer)
        sub = _CLASSES.get(base)
        if sub is None:
            sub = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                       {"__module__": __name__, "__qualname__": f"Distributed{base.__name__}"})
            _CLASSES[base] = sub
        return object.__new__(sub)

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: str | Compressor | Method = "none",
                 transport: str | Transport = "auto", *, method: str | None = None,
                 transport_kwargs: dict | None = None, fabric: Fabric | None = None,
                 bucket_cap_mb: float = 25.0, warmup_steps: int = 0, min_compress_size: int = 0,
                 seed: int = 0, **hyper: Any) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if warmup_steps < 0 or min_compress_size < 0:
            raise ValueError("warmup_steps and min_compress_size must be non-negative")
        # share everything of the inner optimizer (param_groups, state, defaults, hooks), except
        # instance-level callables bound to it (an LR scheduler's patched ``step``)
        for k, v in optimizer.__dict__.items():
            if callable(v) and getattr(v, "__self__", None) is optimizer or k in ("step", "zero_grad"):
                continue
            self.__dict__[k] = v
        self._sc_inner = optimizer
        try:
            self._sc_pipeline = CommPipeline(compressor, transport, method=method,
                                             transport_kwargs=transport_kwargs, fabric=fabric, seed=seed,
                                             **hyper)
        except HyperParameterError as e:
            raise HyperParameterError(
                f"{e}. DistributedOptimizer's own options: method, transport, transport_kwargs, fabric, "
                f"bucket_cap_mb, warmup_steps, min_compress_size, seed; every other keyword argument is a "
                f"hyper-parameter of the method/compressor") from None
        self._sc_cap_bytes = int(bucket_cap_mb * 2 ** 20)
        self._sc_min_compress = int(min_compress_size)
        self._sc_warmup = int(warmup_steps)
        self._sc_steps = 0
        self._sc_synced = False
        self._sc_skip = False
        self._sc_buckets: list[_Bucket] | None = None
        self._sc_param_ids: tuple[int, ...] = ()

    # ------------------------------------------------------------------ properties
    @property
    def method(self) -> Method:
        return self._sc_pipeline.method

    @property
    def transport(self) -> Transport:
        return self._sc_pipeline.transport

    @property
    def fabric(self) -> Fabric:
        return self._sc_pipeline.fabric

    @property
    def last_stats(self) -> CommStats:
        """The last synchronisation's CommStats, summed over its buckets."""
        return self._sc_pipeline.last_stats

    @property
    def sync_steps(self) -> int:
        """Number of synchronisations so far (the warm-up counter)."""
        return self._sc_steps

    def compression_stats(self) -> dict[str, float]:
        """Cumulative ``bytes_dense`` (before), ``bytes_payload`` (after, as declared by the
        compressor), their ``ratio``, and the transport's measured ``bytes_sent``/``bytes_received``/
        ``messages`` (and ``modelled_time_s`` on SimFabric), per worker; next to them the declared
        bytes scaled to the transport (``bytes_declared_sent``), ``sent_over_declared`` and the ratio
        measured on the wire (``ratio_sent``): see :meth:`CompressionStats.as_dict`."""
        d = self._sc_pipeline.totals().as_dict()
        d["steps"] = self._sc_steps
        return d

    def buckets(self) -> list[dict[str, Any]]:
        """The bucket layout: key, numel, dtype, whether compressed, and the parameters' indices."""
        index = {id(p): i for i, p in enumerate(self._trainable())}
        return [{"key": b.key, "numel": b.numel, "dtype": b.dtype, "compress": b.compress,
                 "params": [index[id(p)] for p in b.params]} for b in self._layout()]

    # ------------------------------------------------------------------ synchronisation
    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _layout(self) -> list[_Bucket]:
        params = self._trainable()
        ids = tuple(id(p) for p in params)
        if self._sc_buckets is None or ids != self._sc_param_ids:
            if self._sc_buckets is not None:
                warnings.warn("DistributedOptimizer: the parameters changed; the buckets are rebuilt and "
                              "the method state is reset", RuntimeWarning, stacklevel=3)
                self.method.reset()
            self._sc_buckets = _layout(params, self._sc_cap_bytes, self._sc_min_compress)
            self._sc_param_ids = ids
        return self._sc_buckets

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the gradients over workers now (through the method and transport)."""
        pipe = self._sc_pipeline
        pipe.begin_step()
        exact = self._sc_steps < self._sc_warmup
        for b in self._layout():
            flat = b.gather()
            est = pipe.reduce(flat, b.key, exact=exact, compress=b.compress)
            b.scatter(est)
        self._sc_steps += 1
        self._sc_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's pattern: ``synchronize(); clip(...); with opt.skip_synchronize(): opt.step()``."""
        self._sc_skip = True
        try:
            yield
        finally:
            self._sc_skip = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            def synced() -> Any:
                loss = closure()
                self.synchronize()
                return loss

            self._sc_synced = False
            try:
                return super().step(synced)  # type: ignore[misc]
            finally:
                self._sc_mark_inner_called()
        if not (self._sc_synced or self._sc_skip):
            self.synchronize()
        self._sc_synced = False
        try:
            return super().step()  # type: ignore[misc]
        finally:
            self._sc_mark_inner_called()

    def _sc_mark_inner_called(self) -> None:
        # an LR scheduler attached to the inner optimizer before wrapping watches the inner's step
        if "step" in self._sc_inner.__dict__:
            self._sc_inner._opt_called = True

    step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it again (hooks run in the inner step)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self._sc_synced = False
        super().zero_grad(set_to_none)  # type: ignore[misc]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        sd = super().state_dict()  # type: ignore[misc]
        sd["sparsecomm"] = {**self._sc_pipeline.state_dict(), "steps": self._sc_steps,
                            "layout": [(b.numel, str(b.dtype), b.compress) for b in self._layout()]}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        extra = state_dict.pop("sparsecomm", None)
        layout = [(b.numel, str(b.dtype), b.compress) for b in self._layout()]
        if extra is not None and [tuple(x) for x in extra.get("layout", [])] != layout:
            raise MismatchError(f"the checkpoint's bucket layout {extra.get('layout')} differs from this "
                                f"optimizer's {layout} (other parameters, bucket_cap_mb or "
                                f"min_compress_size)")
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # torch installs new ``state``/``param_groups`` objects: keep the inner optimizer sharing them
        # (an LR scheduler attached to it before wrapping must see the loaded groups)
        self._sc_inner.__dict__.update(state=self.state, param_groups=self.param_groups)
        if extra is None:
            self.method.reset()
            return
        self._sc_pipeline.load_state_dict(extra)
        self._sc_steps = int(extra.get("steps", 0))
        self._sc_synced = False

    def __repr__(self) -> str:
        inner = super().__repr__()  # type: ignore[misc]
        return (f"DistributedOptimizer(method={self.method!r}, transport={self.transport.name!r}, "
                f"world_size={self._sc_pipeline.world_size})\n{inner}")
