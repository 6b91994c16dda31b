"""DistributedOptimizer: buckets -> method -> transport -> averaged gradient -> inner step.

>>> import torch
>>> import sparsecomm as sc
>>> def fn(ctx):
...     with ctx.seeded(0):                                    # the same initial weights on every rank
...         model = torch.nn.Linear(8, 1)
...     opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
...                                   compressor="diana", transport="omnireduce", ratio=0.25)
...     g = torch.Generator().manual_seed(ctx.rank)            # each worker its own data
...     for _ in range(2):
...         x = torch.randn(16, 8, generator=g)
...         opt.zero_grad(); torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward(); opt.step()
...     return model.weight.detach().clone()
>>> w = sc.launch(fn, world_size=2, backend="sim")
>>> all(torch.equal(w[0], wr) for wr in w)                   # every worker applied the same update
True

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

**Overlap** (``overlap=True``, the default). As Horovod does, a hook on every parameter's gradient
accumulator (``register_post_accumulate_grad_hook``) counts the gradients as backward produces them;
once every parameter of a bucket has its gradient (``backward_passes_per_step`` accumulations each),
the bucket is gathered, encoded and *started* (:meth:`CommPipeline.start`): its communication runs on
the fabric's communication thread while backward goes on. Buckets are started in one fixed order, the
reverse of the layout (backward produces the last layers first), and a bucket waits for the ones before
it in that order, so every worker submits the same calls in the same order (no negotiation needed);
``step()`` (or :meth:`synchronize`) starts what is left (a parameter that got no gradient holds its
bucket back until then) and waits only for what is still in flight. The synchronous path
(``overlap=False``) encodes the buckets in the same order, so both give bit-identical results, method
state included. Hooks are active from the second synchronisation on (the first decides which
gradients are sparse). Do not change ``p.grad`` between ``backward`` and ``step()`` other than through
``synchronize()``; ``zero_grad()`` with buckets in flight raises (call ``step()`` or ``synchronize()``).

**Sparse gradients.** At the first synchronisation the workers agree (one tiny all-reduce) on the
parameters whose gradient is a ``torch.sparse_coo`` tensor (``nn.Embedding(sparse=True)``); each gets a
bucket of its own. With plain averaging (``compressor="none"``) the table is never densified
(:meth:`CommPipeline.start_sparse`: the union of the workers' rows, as a ``sparse`` payload of row
indices where the transport carries one, then the union's rows summed compactly) and ``p.grad`` comes
back as a coalesced sparse tensor over the union of the rows, as DDP's sparse allreduce gives it (so
``torch.optim.SparseAdam`` and ``SGD`` with sparse gradients work). With a compressing method the rows
are scattered into the bucket, which goes through the method as a dense bucket, and ``p.grad`` comes back
sparse (the rows whose estimate is non-zero).

**Replicas.** ``init_sync="broadcast"`` (default): at construction rank 0's parameters (and the
buffers of ``module=``, if given) are copied to every worker, as DDP does, after checking that every
worker has the same shapes and dtypes (:class:`~sparsecomm.errors.MismatchError` on every worker
otherwise). ``"check"`` compares them (a digest of their bytes) and raises ``MismatchError`` on every
worker if any differs; ``"off"`` does nothing.

**Non-finite gradients.** ``nonfinite="raise"`` (default) or ``"pass"``: see :mod:`sparsecomm.pipeline`.

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
from .errors import MismatchError, SparseCommError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import HyperParameterError, Method
# the pipeline's builders, re-exported: ``sparsecomm.optim.check_pair`` etc. are documented names
from .pipeline import (AUTO_ORDER, CommPipeline, CompressionStats, build_method, build_transport, check_pair,
                       default_fabric, row_sparse_parts)
from .transports.base import CommWork, Transport
from .replicas import sync_replicas

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
    sparse: bool = False        # one parameter with a sparse gradient, carried as a sparse payload
    ready: int = 0              # parameters whose gradient is in (overlap)

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
            elif g.is_sparse:
                g = g.coalesce()
                view.zero_()
                rows = view.view(p.shape)
                rows.index_put_((g.indices()[0],), g.values().to(self.dtype), accumulate=True)
            else:
                view.copy_(g.reshape(-1))
        return buf

    def scatter(self, est: torch.Tensor, sparse_ids: frozenset[int] = frozenset()) -> None:
        """``p.grad`` becomes a view of ``est`` (a fresh tensor every step: no copy), as DDP's
        ``gradient_as_bucket_view``; a parameter whose gradient is sparse gets the non-zero rows."""
        same = est.dtype == self.dtype and est.device == self.device
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            v = est[off:off + n].view_as(p)
            v = v if same else v.to(device=p.device, dtype=p.dtype)
            p.grad = dense_to_sparse_rows(v) if id(p) in sparse_ids else v


def sparse_payload(g: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype):
    """A coalesced row-sparse gradient ``g`` (``None``: no rows) of a parameter of ``shape`` as a
    ``sparse`` payload over the parameter's flat elements: element indices ``row * row_len + j`` and the
    rows' values (nothing densified)."""
    from .payload import Payload

    numel = int(shape.numel())
    rows, vals2d = row_sparse_parts(g, torch.Size(shape), dtype)
    row_len = vals2d.shape[1]
    idx = (rows[:, None] * row_len + torch.arange(row_len, device=rows.device)).reshape(-1)
    vals = vals2d.reshape(-1)
    bits = (vals.numel() * vals.element_size() + idx.numel() * 8) * 8
    return Payload(kind="sparse", values=vals, indices=idx, shape=torch.Size([numel]), dtype=dtype, bits=bits)


def dense_to_sparse_rows(dense: torch.Tensor) -> torch.Tensor:
    """A coalesced sparse COO tensor holding the rows of ``dense`` that are not all zero (a NaN row
    counts as non-zero)."""
    if dense.dim() == 0:
        return dense
    rows_view = dense.reshape(dense.shape[0], -1)
    keep = rows_view.ne(0).any(dim=1).nonzero().flatten()
    return torch.sparse_coo_tensor(keep[None], dense[keep], dense.shape, is_coalesced=True,
                                   check_invariants=False)


def _layout(params: list[torch.nn.Parameter], cap_bytes: int, min_compress_size: int,
            sparse_ids: frozenset[int] = frozenset()) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    open_: dict[tuple, _Bucket] = {}
    for p in params:
        if id(p) in sparse_ids:
            b = _Bucket(len(buckets), [p], p.dtype, p.device, p.numel() >= min_compress_size, p.numel(),
                        [0], sparse=True)
            buckets.append(b)
            continue
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
    seed=0, overlap=True, backward_passes_per_step=1, init_sync="broadcast", module=None,
    nonfinite="raise", **hyper)``
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
                 seed: int = 0, overlap: bool = True, backward_passes_per_step: int = 1,
                 init_sync: str = "broadcast", module: torch.nn.Module | None = None,
                 nonfinite: str = "raise", **hyper: Any) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if init_sync not in ("broadcast", "check", "off"):
            raise ValueError(f"init_sync must be 'broadcast', 'check' or 'off', got {init_sync!r}")
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
                                             nonfinite=nonfinite, **hyper)
        except HyperParameterError as e:
            raise HyperParameterError(
                f"{e}. DistributedOptimizer's own options: method, transport, transport_kwargs, fabric, "
                f"bucket_cap_mb, warmup_steps, min_compress_size, seed, overlap, backward_passes_per_step, "
                f"init_sync, module, nonfinite; every other keyword argument is a "
                f"hyper-parameter of the method/compressor") from None
        self._sc_cap_bytes = int(bucket_cap_mb * 2 ** 20)
        self._sc_min_compress = int(min_compress_size)
        self._sc_warmup = int(warmup_steps)
        self._sc_steps = 0
        self._sc_synced = False
        self._sc_skip = False
        self._sc_buckets: list[_Bucket] | None = None
        self._sc_param_ids: tuple[int, ...] = ()
        self._sc_overlap = bool(overlap)
        self._sc_passes = int(backward_passes_per_step)
        self._sc_sparse: frozenset[int] | None = None       # ids of params with sparse grads (agreed)
        self._sc_order: list[_Bucket] = []                  # start order: the layout reversed
        self._sc_next = 0                                   # next bucket to start in that order
        self._sc_works: list[tuple[_Bucket, CommWork]] = []
        self._sc_fired: dict[int, int] = {}
        self._sc_bucket_of: dict[int, _Bucket] = {}
        self._sc_hooks: list[Any] = []
        self._sc_in_step = False
        if init_sync != "off":
            tensors = [p for g in self.param_groups for p in g["params"]]
            if module is not None:
                seen = {id(t) for t in tensors}
                tensors += [p for p in module.parameters() if id(p) not in seen]
                tensors += list(module.buffers())
            sync_replicas(self._sc_pipeline.fabric, tensors, mode=init_sync)

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
                self._sc_sparse = None
            self._build_layout(params)
        return self._sc_buckets  # type: ignore[return-value]

    def _build_layout(self, params: list[torch.nn.Parameter]) -> None:
        self._sc_buckets = _layout(params, self._sc_cap_bytes, self._sc_min_compress,
                                   self._sc_sparse or frozenset())
        self._sc_param_ids = tuple(id(p) for p in params)
        self._sc_order = list(reversed(self._sc_buckets))
        self._sc_bucket_of = {id(p): b for b in self._sc_buckets for p in b.params}
        for h in self._sc_hooks:
            h.remove()
        self._sc_hooks = []
        if self._sc_overlap:
            for p in params:
                self._sc_hooks.append(p.register_post_accumulate_grad_hook(self._sc_grad_ready))

    def _agree_sparse(self) -> None:
        """First synchronisation: agree on the parameters with sparse gradients; rebuild the layout if
        there are any (each gets a bucket of its own)."""
        params = self._trainable()
        flags = torch.tensor([1.0 if p.grad is not None and p.grad.is_sparse else 0.0 for p in params],
                             dtype=torch.float32)
        if self._sc_pipeline.world_size > 1 and flags.numel():
            flags = self._sc_pipeline.transport.allreduce(flags)
        self._sc_sparse = frozenset(id(p) for p, f in zip(params, flags.tolist()) if f > 0)
        if self._sc_sparse:
            if self.method.keys():
                raise MismatchError("the method has state for a layout without the sparse-gradient "
                                    "buckets (a checkpoint loaded before the first step); load it after one step")
            self._build_layout(params)

    def _sc_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: start every bucket that is complete, in the fixed order."""
        if self._sc_sparse is None or self._sc_synced:
            return    # the first step (sparse gradients not agreed yet), or a backward after synchronize()
        n = self._sc_fired.get(id(p), 0) + 1
        self._sc_fired[id(p)] = n
        if n > self._sc_passes:
            raise SparseCommError(
                f"a gradient was accumulated {n} times before step() but backward_passes_per_step="
                f"{self._sc_passes}: its bucket was already started with the first gradient. Pass "
                f"backward_passes_per_step={n} (gradient accumulation) or overlap=False")
        if n != self._sc_passes:
            return
        b = self._sc_bucket_of.get(id(p))
        if b is None:
            return
        b.ready += 1
        with torch.no_grad():
            while self._sc_next < len(self._sc_order):
                nb = self._sc_order[self._sc_next]
                if nb.ready < len(nb.params):
                    break
                self._start_bucket(nb)

    def _start_bucket(self, b: _Bucket) -> None:
        pipe = self._sc_pipeline
        if not self._sc_in_step:
            pipe.begin_step()
            self._sc_in_step = True
        exact = self._sc_steps < self._sc_warmup
        if b.sparse and self._sparse_payloads():
            p = b.params[0]
            work = pipe.start_sparse(p.grad, p.shape, b.key, p.dtype)
        else:
            work = pipe.start(b.gather(), b.key, exact=exact, compress=b.compress,
                              shapes=[p.shape for p in b.params])
        self._sc_works.append((b, work))
        self._sc_next += 1

    def _sparse_payloads(self) -> bool:
        return self._sc_pipeline._plain

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the gradients over workers now: start the buckets not started yet (in the fixed
        order) and wait for all of them."""
        if self._sc_sparse is None:
            self._layout()
            self._agree_sparse()
        self._layout()
        try:
            while self._sc_next < len(self._sc_order):
                self._start_bucket(self._sc_order[self._sc_next])
            sparse = self._sc_sparse or frozenset()
            for b, work in self._sc_works:
                est = work.wait()
                if b.sparse and self._sparse_payloads():
                    b.params[0].grad = est
                else:
                    b.scatter(est, sparse)
        finally:
            self._sc_reset_round()
        self._sc_steps += 1
        self._sc_synced = True

    def _sc_reset_round(self) -> None:
        for b in self._sc_order:
            b.ready = 0
        self._sc_works = []
        self._sc_next = 0
        self._sc_fired = {}
        self._sc_in_step = False

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
        if self._sc_works:
            raise SparseCommError(
                f"zero_grad() with {len(self._sc_works)} bucket(s) in flight (started by backward): call "
                f"step() or synchronize() first, so that every worker completes the same rounds")
        self._sc_fired = {}
        for b in self._sc_order:
            b.ready = 0
        self._sc_synced = False
        super().zero_grad(set_to_none)  # type: ignore[misc]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        sd = super().state_dict()  # type: ignore[misc]
        layout = [(b.numel, str(b.dtype), b.compress) for b in self._layout()]
        sparse = None if self._sc_sparse is None else \
            [i for i, p in enumerate(self._trainable()) if id(p) in self._sc_sparse]
        sd["sparsecomm"] = {**self._sc_pipeline.state_dict(), "steps": self._sc_steps, "layout": layout,
                            "sparse": sparse}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        extra = state_dict.pop("sparsecomm", None)
        if self._sc_works:
            raise SparseCommError("load_state_dict() with buckets in flight: call step() or synchronize() first")
        params = self._layout() and self._trainable()
        if extra is not None and extra.get("sparse") is not None:
            # the sparse-gradient buckets the checkpoint was taken with (agreed at its first step)
            idx = extra["sparse"]
            if any(not 0 <= i < len(params) for i in idx):
                raise MismatchError(f"the checkpoint's sparse-gradient parameters {idx} do not exist here "
                                    f"({len(params)} parameters)")
            want = frozenset(id(params[i]) for i in idx)
            if want != (self._sc_sparse or frozenset()) or self._sc_sparse is None:
                self._sc_sparse = want
                self._build_layout(params)
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
