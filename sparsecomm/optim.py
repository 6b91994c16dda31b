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
the bucket is gathered, encoded and *started* (:meth:`CommPipeline.start
<sparsecomm.pipeline.core.CommPipeline.start>`): its communication runs on
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
(:class:`~sparsecomm.pipeline.sparse_rows.SparseRows`: ``sparse_rows="gather"``, the default, gathers every worker's rows
and values once, as gloo's sparse allreduce, and coalesces them; ``sparse_rows="transport"`` takes the
union of the rows through the transport, then sums the union's rows with it) and ``p.grad`` comes
back as a coalesced sparse tensor over the union of the rows, as DDP's sparse allreduce gives it (so
``torch.optim.SparseAdam`` and ``SGD`` with sparse gradients work). With a compressing method the rows
are scattered into the bucket, which goes through the method as a dense bucket, and ``p.grad`` comes back
sparse (the rows whose estimate is non-zero).

**Settings.** At construction every worker checks that every worker was built with the same settings
(the method, the compressor and their hyper-parameters, the transport and ``transport_kwargs``,
``warmup_steps``, ``seed``, ``nonfinite``, ``sparse_rows``, ``bucket_cap_mb``, ``min_compress_size``,
``init_sync``, ``verify_replicas_every``: :func:`sparsecomm.pipeline.settings.agree`, a digest per worker): a
difference raises :class:`~sparsecomm.errors.MismatchError` on every worker, naming the first setting
that differs with both values and both workers (``ratio of compressor 'randk' is 0.25 on worker 0 and
0.1 on worker 1``).

**Replicas.** ``init_sync="broadcast"`` (default): at construction rank 0's parameters (and the
buffers of ``module=``, if given) are copied to every worker, as DDP does, after checking that every
worker has the same shapes and dtypes (:class:`~sparsecomm.errors.MismatchError` on every worker
otherwise). ``"check"`` compares them (a digest of their bytes) and raises ``MismatchError`` on every
worker if any differs; ``"off"`` does nothing. During training, ``verify_replicas_every=N`` (default
:data:`~sparsecomm.replicas.VERIFY_EVERY`, 0: never) compares the workers' parameters after every
N-th step (a checksum each, :func:`~sparsecomm.replicas.verify_replicas`) and raises ``MismatchError``
on every worker, naming the first parameter that differs (by its name in ``module=``, else by its
place in ``param_groups``), so that replicas that drift apart stop the run instead of training on
silently.

**Non-finite gradients.** ``nonfinite="raise"`` (default), ``"skip"`` or ``"pass"``: see
:mod:`sparsecomm.pipeline.nonfinite`. With ``"skip"``, a step whose gradients hold a NaN or Inf on some
worker is dropped on every worker: ``step()`` runs no inner step, the method states (EF's error, DIANA's
h_i, PowerSGD's Q) and the compressor's generators are as before it, the averaged gradients hold NaN
where the sum was not finite, and ``compression_stats()["skipped_steps"]`` counts it (each step copies the
method states it touches, into a second copy of them kept between steps).

**Mixed precision.** ``torch.amp.GradScaler`` works with the plain recipe (``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()``) and ``nonfinite="skip"``: the optimizer declares that it handles the
scaling (``_step_supports_amp_scaling``), so ``scaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)``,
which averages the (scaled) gradients, unscales the averages with the scaler and records the scaler's inf
check on them: every worker skips the same steps and its scaler lowers its scale alike. (torch warns that
it will stop passing the scaler, a ``FutureWarning`` once per call site.) ``scaler.unscale_(opt)`` before
``scaler.step(opt)`` (gradient clipping) unscales this worker's own gradients; call ``opt.synchronize()``
first to clip the averaged ones, as Horovod's recipe does. A closure is not supported with ``"skip"``.

**Compressor / method.** ``compressor=`` takes compressors: a name (``sc.compressors.available()``)
or a ``Compressor`` object; ``method=`` takes methods: a name (``sc.methods.available()``, ``"none"``
by default) built around the compressor (its default compressor when none is given) or a ``Method``
object (with its own compressor). The flat form of command lines, ``compressor=<method name>``, builds
that method with its default compressor (:func:`sparsecomm.methods.build`). Further keyword arguments
are hyper-parameters of the method/compressor (a keyword neither takes raises
:class:`~sparsecomm.errors.HyperParameterError` naming both parameter lists)::

    DistributedOptimizer(inner, compressor="topk", ratio=0.01)                 # none + top-k
    DistributedOptimizer(inner, compressor="topk", method="ef", ratio=0.01)    # EF + top-k
    DistributedOptimizer(inner, compressor="diana", ratio=0.01, alpha=0.05)    # DIANA + rand-k (flat form)
    DistributedOptimizer(inner, method="diana", ratio=0.01, alpha=0.05)        # the same
    DistributedOptimizer(inner, method=sc.methods.get("ef21", compressor="topk", ratio=0.01))
    DistributedOptimizer(inner, compressor=sc.compressors.randk(ratio=0.01), method="diana")   # typed
    DistributedOptimizer(inner, method=sc.methods.ef21(sc.compressors.topk(ratio=0.01)))

``transport=`` is a transport name (hyper-parameters in ``transport_kwargs=``; a transport that
takes ``inplace`` gets ``inplace=True`` unless told otherwise, since the buckets are scratch), a
``Transport`` object, ``"default"`` (the default: the payload kind's default transport, one for the whole
model, fixed at construction: the first of ring, omnireduce, switch, allgather that carries the payload;
``native`` for dense payloads on a torch.distributed fabric; allgather first for scattered ``sparse``
payloads such as top-k, and for natural compression while ``n < 64/9``, where it ships fewer bytes:
see :mod:`sparsecomm.pipeline.resolve`), or ``"auto"``: a transport per bucket, chosen and revisited
by a cost model checked against the machine (:mod:`sparsecomm.pipeline.auto`; its decisions depend on
measured times, so on real processes two runs may sum in different orders). An invalid compressor x transport pair
(top-k's worker-specific indices on ``ring``) raises :class:`~sparsecomm.errors.IncompatibleError`
at construction, naming the pair, the transports that would carry it and the compressors the
transport would carry. ``fabric=`` defaults to the one :func:`sparsecomm.launch` set up
(:func:`sparsecomm.launch.current_context`), else a ``TorchFabric`` over an initialised default
process group.

**Process groups.** ``process_group=pg`` (a ``torch.distributed`` group, instead of ``fabric=``)
averages over ``pg``'s members only: the transport runs over ``TorchFabric(group=pg)``, whose workers
are the members numbered by their rank in ``pg`` and whose messages and collectives travel on ``pg``'s
own channels, so the data-parallel groups of one job (``{0,1}`` and ``{2,3}`` of 4 ranks) each average
within themselves without meeting; the replicas are broadcast from ``pg``'s rank 0 and the checks above
compare ``pg``'s members. Every rank builds the optimizer over its own group (a rank outside ``pg``
gets :class:`~sparsecomm.errors.InvalidValueError`). Every transport without services runs over a
group (ring, omnireduce with its aggregators sharded over the workers, native, allgather); the switch
and sparse switch need a service rank per group, which the launcher does not start, and are refused
with :class:`~sparsecomm.errors.ServiceNotStarted` naming those transports. ``None``, the default
group or the launch's workers' group: the default fabric, as without it.

**Researcher options.** ``warmup_steps`` (default 0): the first steps communicate uncompressed
(*exact* rounds of the method, which warm-start its state: see :mod:`sparsecomm.methods.base`); the
method is wrapped in :func:`sparsecomm.methods.warmup`, whose round count is part of each state.
``min_compress_size`` (default 0): parameters with fewer elements go to separate buckets that are
always averaged uncompressed, bypassing the method. ``seed``: one ``torch.Generator`` per worker for
the compressor, seeded ``seed`` on every worker when the compressor declares ``shared_randomness``
(so shared-seed rand-k draws the same coordinates everywhere and advances identically), else
``seed + rank``.

**Step size.** ``opt.step_size_hint`` (:mod:`sparsecomm.pipeline.step_size`): the method's variance factor
(omega or delta at the compressed buckets' sizes) and the scale theory puts on a learning rate that
suits uncompressed training (DIANA: 1/(1 + 6 omega/n)); rank 0 warns once at construction
(:class:`~sparsecomm.pipeline.step_size.StepSizeWarning`) where that scale is below 1/4 for a method whose
step bound carries omega.

**Logging.** ``last_stats``: the last synchronisation's :class:`~sparsecomm.fabric.stats.CommStats`
summed over buckets (bytes, messages; modelled time on SimFabric). :meth:`compression_stats`:
cumulative bytes before (dense) and after (declared payload bits) compression and their quotient
``compression_factor``, next to the bytes the transport's ledger counted (``bytes_sent``), what it would
count if payloads travelled as declared (``bytes_declared_sent``), their quotient ``sent_over_declared``
and the compression factor measured on the wire (``compression_factor_sent``); see
:class:`~sparsecomm.pipeline.accounting.CompressionStats`.

**Under DDP.** Parameters that a stock ``DistributedDataParallel`` averages (it all-reduces the dense
gradient in backward) are refused with :class:`~sparsecomm.errors.IncompatibleError`, however the
optimizer reaches them (the wrapper's or its module's parameters, param groups, ``module=``): at
construction, or at the first step for a model wrapped after the optimizer was built
(:mod:`sparsecomm.ddp_wrapped`). Train the bare module with this optimizer, or keep DDP with a plain
torch optimizer and compress in its hook (:func:`sparsecomm.ddp.register`).

**Lightning.** Not as a ``configure_optimizers`` result: Lightning's multi-process strategies wrap the
module in ``DistributedDataParallel``, which already averages the gradients, and its checkpoints carry
rank 0's optimizer state to every rank; use the DDP hook there
(:class:`sparsecomm.integrations.lightning.CommHook`, whose module doc has the details).

**Checkpoints.** ``state_dict()`` is the inner optimizer's plus a ``"sparsecomm"`` entry: the method
state (per worker: EF residuals, DIANA's h_i), the step counter, the generator state, the bucket
layout, rank and world size, the compressor's name; never a fabric or process group. Every rank saves
its own (:mod:`sparsecomm.checkpoint` saves a file whole and names a truncated one). Loading a state
saved with another world size or rank, another layout, or by another method or compressor raises
:class:`~sparsecomm.errors.MismatchError`; delete the ``"sparsecomm"`` entry to load only the inner
optimizer's state (the method then starts afresh, as DeepSpeed does for its error feedback).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .compressors.base import Compressor
from .ddp_wrapped import refuse_wrapped
from .errors import InvalidTypeError, InvalidValueError, MismatchError, SparseCommError
from .fabric.base import Fabric
from .fabric.stats import CommStats
from .methods.base import Method
from .pipeline import CommPipeline, step_size
from .pipeline.buckets import layout as bucket_layout
from .pipeline.resolve import default_fabric
from .pipeline.scheduler import BucketScheduler
from .pipeline.settings import agree
from .transports.base import Transport
from .replicas import VERIFY_EVERY, check_verify_every, sync_replicas, verify_replicas
from .validate import check_int, check_real, check_seed

__all__ = ["DistributedOptimizer"]

# ============================================================================ the optimizer
_CLASSES: dict[type, type] = {}


class DistributedOptimizer:
    """Wrap a torch optimizer so that ``step()`` averages (compressed) gradients first; see the module doc.

    It owns a :class:`~sparsecomm.pipeline.core.CommPipeline` (method + transport) and the
    :class:`~sparsecomm.pipeline.scheduler.BucketScheduler` that runs its buckets through it.

    Args:
        optimizer: the inner ``torch.optim.Optimizer``; the result is an instance of its class (and of this
            one) sharing its ``param_groups`` and ``state``.
        compressor: a compressor name (``sc.compressors.available()``), a ``Compressor``, or the flat form
            ``compressor=<method name>``; ``None``: the method's default.
        transport: a transport name (``sc.transports.available()``), a ``Transport``, ``"default"`` (the
            payload kind's default transport) or ``"auto"`` (a transport per bucket, measured).
        method: a method name (``sc.methods.available()``, ``"none"`` by default) or a ``Method`` object.
        transport_kwargs: hyper-parameters of a transport given by name.
        fabric: the fabric to communicate over; default: the current :func:`sparsecomm.launch` worker's, else
            a ``TorchFabric`` over the default process group.
        process_group: a ``torch.distributed`` group to average over instead of ``fabric=`` (its members
            only; see "Process groups" in the module doc).
        bucket_cap_mb: the largest bucket, in MiB (a larger tensor gets a bucket of its own).
        warmup_steps: the first steps communicate uncompressed (exact rounds of the method).
        min_compress_size: parameters with fewer elements are averaged uncompressed, in buckets of their own.
        seed: seeds the compressor's generator: ``seed`` on every worker for shared randomness, else ``seed +
            rank``.
        overlap: start each bucket's communication during backward (``False``: all in ``step()``;
            bit-identical).
        backward_passes_per_step: gradient accumulations per step: a bucket starts after this many backward
            passes.
        init_sync: ``"broadcast"`` (rank 0's parameters to every worker), ``"check"`` (compare them) or
            ``"off"``.
        module: the model, whose buffers are broadcast too and whose parameter names appear in errors.
        nonfinite: ``"raise"`` (a NaN/Inf gradient is the same ``NonFiniteError`` on every worker), ``"skip"``
            (such a step is dropped on every worker with nothing changed: mixed precision) or ``"pass"``.
        sparse_rows: how row-sparse (embedding) gradients are averaged: ``"gather"`` or ``"transport"``.
        verify_replicas_every: compare the workers' parameters every N steps (0: never).
        **hyper: hyper-parameters of the method and its compressor (``ratio=0.01``, ``alpha=0.5``).
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        if isinstance(optimizer, DistributedOptimizer):
            raise InvalidTypeError("the optimizer is already a DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer)!r}")
        base = type(optimizer)
        sub = _CLASSES.get(base)
        if sub is None:
            sub = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                       {"__module__": __name__, "__qualname__": f"Distributed{base.__name__}"})
            _CLASSES[base] = sub
        return object.__new__(sub)

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: str | Compressor | None = None,
                 transport: str | Transport = "default", *, method: str | Method | None = None,
                 transport_kwargs: dict | None = None, fabric: Fabric | None = None,
                 process_group: Any = None, bucket_cap_mb: float = 25.0, warmup_steps: int = 0,
                 min_compress_size: int = 0, seed: int = 0, overlap: bool = True,
                 backward_passes_per_step: int = 1,
                 init_sync: str = "broadcast", module: torch.nn.Module | None = None,
                 nonfinite: str = "raise", sparse_rows: str = "gather",
                 verify_replicas_every: int = VERIFY_EVERY, **hyper: Any) -> None:
        who = "DistributedOptimizer"
        backward_passes_per_step = check_int("backward_passes_per_step", backward_passes_per_step, low=1, what=who)
        if init_sync not in ("broadcast", "check", "off"):
            raise InvalidValueError(f"init_sync must be 'broadcast', 'check' or 'off', got {init_sync!r}")
        bucket_cap_mb = check_real("bucket_cap_mb", bucket_cap_mb, low=0.0, low_open=True, what=who)
        warmup_steps = check_int("warmup_steps", warmup_steps, low=0, what=who)
        min_compress_size = check_int("min_compress_size", min_compress_size, low=0, what=who)
        seed = check_seed("seed", seed, what=who)
        # parameters that stock DDP already averages (built before this optimizer; after it: at the first step)
        refuse_wrapped([p for g in optimizer.param_groups for p in g["params"]], module)
        if process_group is not None:
            if fabric is not None:
                raise InvalidValueError("pass fabric= or process_group=, not both (process_group=pg runs the "
                                        "transport over TorchFabric(group=pg))")
            fabric = default_fabric(process_group)
        # share everything of the inner optimizer (param_groups, state, defaults, hooks), except
        # instance-level callables bound to it (an LR scheduler's patched ``step``)
        for k, v in optimizer.__dict__.items():
            if callable(v) and getattr(v, "__self__", None) is optimizer or k in ("step", "zero_grad"):
                continue
            self.__dict__[k] = v
        self._sc_inner = optimizer
        # keywords not named above are the method's / compressor's (a bad one raises in the catalog)
        self._sc_pipeline = CommPipeline(compressor, transport, method=method,
                                         transport_kwargs=transport_kwargs, fabric=fabric, seed=seed,
                                         nonfinite=nonfinite, sparse_rows=sparse_rows,
                                         warmup_steps=warmup_steps, **hyper)
        cap_bytes = int(bucket_cap_mb * 2 ** 20)
        self._sc_scheduler = BucketScheduler(self._sc_pipeline, self, cap_bytes, int(min_compress_size),
                                             bool(overlap), int(backward_passes_per_step))
        self._sc_skip = False
        self._sc_verify_every = check_verify_every(verify_replicas_every)
        self._sc_names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        compressed = [b.numel for b in bucket_layout(self._sc_scheduler.params(), cap_bytes, int(min_compress_size))
                      if b.compress]
        self._sc_step_hint = step_size.hint(self.method, self._sc_pipeline.world_size, compressed)
        if self._sc_pipeline.rank == 0:
            step_size.check(self.step_size_hint, [g.get("lr") for g in self.param_groups], "opt.step_size_hint",
                            base=optimizer.defaults.get("lr"))
        agree(self._sc_pipeline.fabric, "DistributedOptimizer", self._sc_pipeline.settings() + [
            ("bucket_cap_mb", repr(float(bucket_cap_mb))), ("min_compress_size", repr(int(min_compress_size))),
            ("init_sync", repr(init_sync)), ("verify_replicas_every", repr(self._sc_verify_every))])
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
        """The method (:class:`~sparsecomm.methods.base.Method`) that encodes and decodes every bucket."""
        return self._sc_pipeline.method

    @property
    def method_states(self) -> dict:
        """The method's state of every bucket (key -> :class:`~sparsecomm.methods.state.MethodState`;
        ``.state`` is the typed state: EF's error, DIANA's shifts); the method object holds none."""
        return self._sc_pipeline.states.by_key

    @property
    def step_size_hint(self) -> step_size.StepSizeHint:
        """What theory says about the step size of this method, at the sizes of the compressed buckets
        (:mod:`sparsecomm.pipeline.step_size`): its variance factor and the scale on a learning rate that
        suits uncompressed training."""
        return self._sc_step_hint

    @property
    def transport(self) -> Transport:
        """The transport (:class:`~sparsecomm.transports.base.Transport`) that sums the buckets' payloads."""
        return self._sc_pipeline.transport

    @property
    def fabric(self) -> Fabric:
        """The fabric the transport communicates over."""
        return self._sc_pipeline.fabric

    @property
    def last_stats(self) -> CommStats:
        """The last synchronisation's CommStats, summed over its buckets."""
        return self._sc_pipeline.last_stats

    @property
    def sync_steps(self) -> int:
        """Number of synchronisations so far (the warm-up counter)."""
        return self._sc_scheduler.steps

    def compression_stats(self) -> dict[str, float]:
        """Cumulative ``bytes_dense`` (before), ``bytes_payload`` (after, as declared by the
        compressor), their quotient ``compression_factor``, and the transport's measured
        ``bytes_sent``/``bytes_received``/``messages`` (and ``modelled_time_s`` on SimFabric), per
        worker; next to them the declared bytes scaled to the transport (``bytes_declared_sent``),
        ``sent_over_declared`` and the factor measured on the wire (``compression_factor_sent``), and
        ``steps``: see :meth:`CompressionStats.as_dict
        <sparsecomm.pipeline.accounting.CompressionStats.as_dict>`."""
        d = self._sc_pipeline.stats.as_dict()
        d["steps"] = self._sc_scheduler.steps
        return d

    def buckets(self) -> list[dict[str, Any]]:
        """The bucket layout: key, numel, dtype, whether compressed, and the parameters' indices."""
        index = {id(p): i for i, p in enumerate(self._sc_scheduler.params())}
        return [{"key": b.key, "numel": b.numel, "dtype": b.dtype, "compress": b.compress,
                 "params": [index[id(p)] for p in b.params]} for b in self._sc_scheduler.layout()]

    # ------------------------------------------------------------------ steps
    def synchronize(self) -> None:
        """Average the gradients over workers now: start the buckets not started yet (in the fixed
        order) and wait for all of them (:meth:`BucketScheduler.synchronize
        <sparsecomm.pipeline.scheduler.BucketScheduler.synchronize>`)."""
        if self._sc_scheduler.sparse is None:          # the first synchronisation (of this layout)
            refuse_wrapped(self._sc_scheduler.params(), when="at the first step: DDP wrapped the model after "
                                                           "the optimizer was built")
        self._sc_scheduler.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's pattern: ``synchronize(); clip(...); with opt.skip_synchronize(): opt.step()``."""
        self._sc_skip = True
        try:
            yield
        finally:
            self._sc_skip = False

    #: ``torch.amp.GradScaler.step(opt)`` hands the whole step to :meth:`step` (with ``grad_scaler=``: torch's
    #: protocol for an optimizer that handles the scaling itself), which unscales and checks the *averaged*
    #: gradients, so that every worker skips the same steps and its scaler makes the same update
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None,  # type: ignore[override]
             grad_scaler: Any = None) -> Any:
        """Synchronise the gradients (unless :meth:`synchronize` already did), then run the inner optimizer's
        step; see the module doc, "Step". Under ``nonfinite="skip"``, a synchronisation that the pipeline
        skipped (a non-finite sum on some worker) runs no inner step, on every worker.

        Args:
            closure: re-evaluates the loss, as for the inner optimizer; every evaluation is synchronised (it
                must run equally often on every worker; not with ``nonfinite="skip"``, which could not drop
                a step the inner optimizer runs itself).
            grad_scaler: the ``torch.amp.GradScaler`` whose ``scaler.step(opt)`` called this (torch passes it):
                the averaged gradients are unscaled and checked here (module doc, "Mixed precision").
        """
        sched = self._sc_scheduler
        if closure is not None:
            if self._sc_pipeline.rule.skip:
                raise InvalidValueError(
                    "step(closure) with nonfinite='skip': the inner optimizer runs the closure (and its "
                    "synchronisation) itself, so a skipped synchronisation could not drop its update; call "
                    "loss = closure() and then step() without a closure, or use nonfinite='raise'")

            def synced() -> Any:
                loss = closure()
                self.synchronize()
                return loss

            sched.synced = False
            try:
                loss = super().step(synced)  # type: ignore[misc]
            finally:
                self._sc_mark_inner_called()
            self._sc_verify()
            return loss
        if not (sched.synced or self._sc_skip):
            self.synchronize()
        sched.synced = False
        skipped, sched.skipped = sched.skipped, False
        if grad_scaler is not None:
            skipped = self._sc_unscale(grad_scaler) or skipped
        if skipped:
            self._sc_verify()
            return None
        try:
            out = super().step()  # type: ignore[misc]
        finally:
            self._sc_mark_inner_called()
        self._sc_verify()
        return out

    def _sc_unscale(self, scaler: Any) -> bool:
        """``scaler``'s unscaling and inf check on the averaged gradients (identical on every worker, so
        every worker's scaler records the same ``found_inf``); returns whether it found an inf or NaN. If
        ``scaler.unscale_(opt)`` ran before the gradients were averaged (torch's clipping recipe), the check
        it recorded, of this worker's own gradients, is made again on the averages."""
        if scaler._found_inf_per_device(self):
            found = scaler._check_inf_per_device(self)
        else:
            scaler.unscale_(self)
            found = scaler._found_inf_per_device(self)
        return bool(sum(float(v.item()) for v in found.values()))

    def _sc_verify(self) -> None:
        """The replica guard (``verify_replicas_every``), after the inner step of every N-th step."""
        every, steps = self._sc_verify_every, self._sc_scheduler.steps
        if every and steps and steps % every == 0:
            named = [(self._sc_names.get(id(p), f"param_groups[{g}]['params'][{i}]"), p)
                     for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])
                     if p.requires_grad]
            verify_replicas(self._sc_pipeline.fabric, named, when=f"after step {steps}")

    def _sc_mark_inner_called(self) -> None:
        # an LR scheduler attached to the inner optimizer before wrapping watches the inner's step
        if "step" in self._sc_inner.__dict__:
            self._sc_inner._opt_called = True

    step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it again (hooks run in the inner step)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """The inner optimizer's ``zero_grad``; raises while buckets are in flight (call ``step()`` or
        ``synchronize()`` first).

        Args:
            set_to_none: as for torch's optimizers: set the gradients to ``None`` instead of zeroing them.
        """
        self._sc_scheduler.clear_ready()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus a ``"sparsecomm"`` entry: the method state, the step counter,
        the generator state, the bucket layout, rank and world size (module doc, "Checkpoints")."""
        sd = super().state_dict()  # type: ignore[misc]
        sched = self._sc_scheduler
        sd["sparsecomm"] = {**self._sc_pipeline.state_dict(), "steps": sched.steps, "layout": sched.signature(),
                            "sparse": sched.sparse_indices()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict` of this rank; another world size, rank, layout, method or compressor
        raises :class:`~sparsecomm.errors.MismatchError`.

        Args:
            state_dict: what :meth:`state_dict` returned (without its ``"sparsecomm"`` entry: the inner
                optimizer's state only, the method starts afresh).
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("sparsecomm", None)
        if extra is not None:               # before anything is loaded: another method's or compressor's state
            self._sc_pipeline.check_saved_by(extra)
        sched = self._sc_scheduler
        if sched.in_flight:
            raise SparseCommError("load_state_dict() with buckets in flight: call step() or synchronize() first")
        sched.layout()
        if extra is not None and extra.get("sparse") is not None:
            # the sparse-gradient buckets the checkpoint was taken with (agreed at its first step)
            sched.restore_sparse(extra["sparse"])
        layout = sched.signature()
        if extra is not None and [tuple(x) for x in extra.get("layout", [])] != layout:
            raise MismatchError(f"the checkpoint's bucket layout {extra.get('layout')} differs from this "
                                f"optimizer's {layout} (other parameters, bucket_cap_mb or "
                                f"min_compress_size)")
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # torch installs new ``state``/``param_groups`` objects: keep the inner optimizer sharing them
        # (an LR scheduler attached to it before wrapping must see the loaded groups)
        self._sc_inner.__dict__.update(state=self.state, param_groups=self.param_groups)
        if extra is None:
            self._sc_pipeline.states.reset()
            return
        self._sc_pipeline.load_state_dict(extra)
        sched.steps = int(extra.get("steps", 0))
        sched.synced = False

    def __repr__(self) -> str:
        inner = super().__repr__()  # type: ignore[misc]
        return (f"DistributedOptimizer(method={self.method!r}, transport={self.transport.name!r}, "
                f"world_size={self._sc_pipeline.world_size})\n{inner}")
