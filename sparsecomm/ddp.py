"""The same pipeline as a DDP communication hook, so compressors run under stock DistributedDataParallel.

DDP needs a torch.distributed process group, which the ``sim`` backend does not have, so this example
is a script on gloo processes (``tests/repo/test_docs.py`` runs it)::

    import torch
    from torch import nn
    import sparsecomm as sc

    def train(ctx):
        net = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))     # broadcasts rank 0's weights
        state = sc.ddp.CommHookState(method=sc.methods.ef(sc.compressors.topk(ratio=0.25)),
                                     transport="allgather")
        net.register_comm_hook(state, sc.ddp.comm_hook)      # or: state = sc.ddp.register(net, ...)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(ctx.rank))
        for _ in range(3):
            opt.zero_grad(); net(x).square().mean().backward(); opt.step()
        return net.module.weight.detach()

    if __name__ == "__main__":
        w = sc.launch(train, world_size=2, backend="gloo")
        assert torch.equal(w[0], w[1])                       # every worker applied the same update

``comm_hook(state, bucket) -> Future[Tensor]`` has the signature ``register_comm_hook`` expects. DDP
hands the hook each bucket's *local* gradients, flat and not divided by the world size; the hook
returns the *average* over workers: ``method.encode -> transport.start -> method.decode``, the
method's ``decode`` dividing the aggregate by the world size (as ``allreduce_hook`` divides). The hook
encodes on the calling (autograd) thread and returns a *pending* future: the transport runs on the
fabric's communication thread (:meth:`~sparsecomm.transports.base.Transport.start`), the decode right
after it there, and the future, chained with ``then`` as torch's hooks chain theirs, completes when the
bucket's communication does, so later buckets' backward runs meanwhile. With ``native`` and plain
averaging or the ``fp16``/``bf16`` casts, a bucket whose call is predicted (every step after the first
few) is posted to gloo on the calling thread at once, behind the buckets still in flight, as torch's
``allreduce_hook`` posts its own, and its completion (the checks, the division, the records, the step's
end) is chained on gloo's own future, in call order, with no hop through the communication thread
(:meth:`HookScheduler.chained <sparsecomm.pipeline.scheduler.HookScheduler.chained>`;
:mod:`sparsecomm.transports.native`, "Posted at once"); a cast's narrow sum is widened and then divided
(torch's ``fp16_compress_hook`` divides before widening), both in one pass, which also checks the sum for
NaN/Inf (as the plain average's division does: :meth:`Method.decode_finite
<sparsecomm.methods.base.Method.decode_finite>`). DDP calls the hook for its
buckets in index order on every rank, so the calls match across ranks; the results are bit-identical
to synchronous calls.

**Sparse gradients** (``nn.Embedding(sparse=True)``): DDP gives such a parameter a bucket of its own
whose buffer is the sparse gradient; with plain averaging (``compressor="none"``, any transport) the
rows travel without densifying the table (:class:`~sparsecomm.pipeline.sparse_rows.SparseRows`: gathered and coalesced
once by default, ``sparse_rows="transport"`` for the two rounds through the transport) and the future holds the
coalesced sparse average. A compressing method is rejected by :func:`register` with an error naming
the alternatives (plain averaging, or :class:`~sparsecomm.DistributedOptimizer`).

**Settings**: building the state is a collective: every worker checks that every worker built it with
the same settings (method, compressor, their hyper-parameters, transport and options, ``warmup_steps``,
``seed``, ``min_compress_size``, ...: :func:`sparsecomm.pipeline.settings.agree`) and raises
:class:`~sparsecomm.errors.MismatchError` naming the first that differs, with both values and both
workers.

**Replicas**: DDP itself broadcasts rank 0's parameters and buffers at construction (and buffers at
every forward with ``broadcast_buffers=True``), so the hook adds nothing there.

:class:`CommHookState` follows ``PowerSGDState``: hyper-parameters (compressor, method, transport,
``warmup_steps``, ``min_compress_size``, ``seed``) apart from internal state (the method's per-bucket
state, the generator, the step counter :attr:`CommHookState.steps`; a step is one DDP iteration).
The method state is keyed by the *parameters* (their names, known when the state is built by
:func:`register` or given ``model=``; else by ``bucket.index()``): DDP rebuilds its buckets after the
first step (also after a restore into a fresh process), so nothing may depend on the layout. A
one-round method whose payloads concatenate (``dense``, ``aligned``, ``sparse``: EF, EF21, DIANA, DGC
around top-k, rand-k, ...) runs *per parameter* (:attr:`CommPipeline.per_parameter
<sparsecomm.pipeline.core.CommPipeline.per_parameter>`): each
parameter has its own state, its own compressor generator (seeded from ``seed`` and its name) and
its own constants (rand-k's ``k``, DIANA's ``alpha``), the parameters' payloads travel concatenated as
the bucket's one message, and the aggregate is decoded slice by slice. **Promise**: the numbers do not depend on the bucket layout, so a
run restored from a checkpoint into a fresh DDP (any ``bucket_cap_mb``) is bit-identical to the
uninterrupted run whenever the transport's per-element sum does not depend on the layout either
(allgather: rank order; any transport at 2 workers), as ``test_hook_resume_diana_randk_any_layout``
checks. Other methods (several rounds, quantized payloads: PowerSGD, the sign methods) keep one state
per bucket, keyed by a digest of its parameters' names, with their segments and shapes recorded
(:meth:`StateStore.bind <sparsecomm.pipeline.states.StateStore.bind>`): a state restored onto another
layout is split into one piece per
parameter and rejoined, as the method declares its state splits
(:meth:`~sparsecomm.methods.base.Method.state_sizes`: per coordinate by default; PowerSGD's warm-start
Q per matrix), so it is reassembled exactly. **PowerSGD's resume** is bit-identical to the
uninterrupted run (under the same condition on the transport) whenever no fresh Q is drawn on a layout
the uninterrupted run did not draw on: with ``warm_start=True`` (the default) and a checkpoint taken
after the first compressed step (any ``bucket_cap_mb``), or taken before it with at least one
step between the restore and the first compressed step (the same ``bucket_cap_mb``), as
``test_hook_resume_powersgd_exact`` checks. It is *not* bit-identical with ``warm_start=False``, or
when the first step after the restore is the first compressed step: fresh Qs are drawn from the
shared generator bucket by bucket (torch's ``powerSGD_hook`` order, which the parity with torch
needs), and a restored process's first step has DDP's initial layout, so its draws follow other
buckets than the uninterrupted run's. The sign methods' rounds are per coordinate (any layout); ``onebit``'s
1-bit blocks run across the bucket, so its resume is bit-identical only from a checkpoint taken in the
warm-up. A stateless method under ``warmup_steps`` keys its round count by the parameters too
(``tests/frontends/test_ddp_resume.py`` checks every method). Step 0 is always averaged uncompressed
and bypasses the method;
compression starts at step ``max(1, warmup_steps)``
and steps ``1 .. warmup_steps - 1`` are exact rounds of the method (warm-starting its state:
the method is wrapped in :func:`sparsecomm.methods.warmup` with ``warmup_steps`` rounds: a state's round
count starts at the number of steps before its first round, so it counts steps from 0);
PowerSGD's ``start_powerSGD_iter`` counts the same way, so it means what it means in torch's hook
(whose iterations are these steps).
Buckets with fewer than ``min_compress_size`` elements are averaged uncompressed (per bucket: a DDP
bucket mixes tensors). The process group, fabric and transport are never pickled (``__getstate__``);
unpickling rebinds to the default process group (also a state built over a subgroup: build
``CommHookState(pg, ...)`` there and ``load_state_dict`` it instead; a method state saved at another
world size or rank is refused). ``state_dict()``/``load_state_dict()`` checkpoint the internal state.

The fabric is the current :func:`sparsecomm.launch` worker's ``TorchFabric``, else a new ``TorchFabric``
over the default process group; the default transport (``"default"``) is then ``native``
(``torch.distributed.all_reduce``) for dense payloads.

**One call a step** (``fuse=``, :func:`~sparsecomm.pipeline.scheduler.resolve_fuse`): with plain averaging on a
protocol of this library (any transport but ``native`` and ``"auto"``), a step's dense buckets run as one call by
default: each bucket's future is held until DDP hands the hook the step's last bucket (or a sparse one), then the
buckets are averaged in one call (one per run of buckets of one dtype): a single bucket as it is, several copied one
after another into one input, each bucket's largest parameter on the transport's block grid
(``Transport.block_grid``: OmniReduce's blocks, the sparse switch's packets; zeros between them, never sent), so
that a row of it that is zero fills whole blocks as in ``DistributedOptimizer``'s layout, where DDP's offsets would
cut it across two. Each bucket's future holds its part of the average as it stands (on the CPU: a tensor whose
storage starts at that part, since DDP reads a hook's result at its bucket offsets from the start of its storage),
which DDP copies into the gradients. The numbers are those of a call per bucket wherever the transport's per-element
sum does not depend on the layout (at 2 workers, ``allgather``); the method state is not involved (plain averaging
has none).
``fuse=False`` runs a call per bucket; ``state.fused`` says what the rule chose.

**Lanes** (``lanes=``, :mod:`sparsecomm.pipeline.lanes`): bucket ``k`` runs on lane ``k mod L``, each lane a
fabric with process groups of its own (:meth:`TorchFabric.lane
<sparsecomm.fabric.torch.torch_fabric.TorchFabric.lane>`, created when the state is built, on every worker in
the same order), its own communication thread and its own transport instance, so a small bucket's call does not
queue behind a large one's. ``None`` (the default) is 2 for ``ring``, ``omnireduce`` (sharded) and ``allgather``
on a gloo fabric with a store and no services when the step is not one call (above) and the model's gradients take
more than one bucket (a state
unpickled without its model: 2 where lanes run), else 1; the number is among the agreed settings. The results are
the same bits; the calls' outcomes are decided in call order across the lanes
(:class:`~sparsecomm.pipeline.lanes.CallOrder`); a chained ``native`` call keeps one lane.

**Process groups**: the hook averages over the process group the DDP model was built with
(``DistributedDataParallel(net, process_group=pg)``; :func:`register` takes it from the model, or
``process_group=pg`` naming the same group): for any other group than the default one or the launch's
workers' group it builds ``TorchFabric(group=pg)`` (:func:`sparsecomm.pipeline.resolve.default_fabric`),
whose workers are ``pg``'s members numbered by their rank in ``pg``, so a job split into data-parallel
groups averages within each group, each on its own channels. Every transport without services runs
there (ring, omnireduce with its aggregators sharded over the workers, native, allgather); the switch
and sparse switch need a service rank per group, which the launcher does not start, and are refused
with :class:`~sparsecomm.errors.ServiceNotStarted` naming those transports.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .deprecation import warn_renamed
from .errors import IncompatibleError, InvalidTypeError
from .fabric.stats import CommStats
from .pipeline import CommPipeline
from .pipeline import step_size
from .pipeline.lanes import Lanes, check_lanes, resolve_lanes
from .pipeline.resolve import default_fabric
from .pipeline.scheduler import HookScheduler, check_fuse, resolve_fuse, sparse_message
from .pipeline.settings import agree
from .replicas import VERIFY_EVERY, check_verify_every, verify_replicas
from .fabric.engine import CommWork
from .validate import check_int, check_seed

_HYPER = ("compressor", "transport", "method", "transport_kwargs", "warmup_steps", "min_compress_size",
          "seed", "sparse_rows", "verify_replicas_every", "lanes", "fuse", "hyper")


class CommHookState:
    """Per-worker state of :func:`comm_hook` (see the module doc).

    ``model`` (the DDP module) names the parameters that key the method state (and those the replica
    guard checks: ``verify_replicas_every=N`` compares the workers' parameters at the start of every
    N-th step and raises :class:`~sparsecomm.errors.MismatchError` on every worker, naming the
    first parameter that differs, :func:`sparsecomm.replicas.verify_replicas`; 0 turns it off);
    ``compressor``,
    ``method``, ``transport`` and ``**hyper`` as for :class:`~sparsecomm.DistributedOptimizer`
    (objects are accepted but then the state cannot be pickled and rebuilt). It owns the
    :class:`~sparsecomm.pipeline.core.CommPipeline` (:attr:`pipeline`) and the
    :class:`~sparsecomm.pipeline.scheduler.HookScheduler` that runs DDP's buckets through it
    (:attr:`scheduler`).

    Args:
        process_group: the group to average over: ``None``, the default group or the current
            :func:`sparsecomm.launch` worker's ``ctx.fabric.native_group`` (the whole job's workers), or a
            subgroup (see "Process groups" in the module doc).
        compressor: as for :class:`~sparsecomm.DistributedOptimizer`.
        transport: as for :class:`~sparsecomm.DistributedOptimizer` (``"default"``: ``native`` for dense
            payloads).
        method: as for :class:`~sparsecomm.DistributedOptimizer`.
        transport_kwargs: hyper-parameters of a transport given by name.
        warmup_steps: steps ``1 .. warmup_steps - 1`` are exact rounds of the method (step 0 is always
            averaged uncompressed).
        min_compress_size: buckets with fewer elements are averaged uncompressed.
        seed: seeds the compressor's generators (per parameter: with its name).
        model: the DDP module: its parameter names key the method state (else ``bucket.index()``).
        sparse_rows: ``"gather"`` or ``"transport"``: how a sparse (embedding) bucket is averaged.
        verify_replicas_every: compare the workers' parameters every N steps (0: never).
        lanes: how many buckets' calls are in flight together, bucket ``k`` on lane ``k mod lanes``, each
            lane a fabric of its own (see "Lanes" in the module doc): ``None``, the default rule (2 where
            lanes run and the model's gradients take more than one bucket, else 1); ``1``, every call on
            the hook's fabric, one at a time; an int ``> 1`` where lanes do not run raises
            :class:`~sparsecomm.errors.IncompatibleError` saying why. The results are the same bits.
        fuse: whether a step's dense buckets run as one call (see "One call a step" in the module doc):
            ``None``, the default rule (plain averaging on any transport but ``native`` and ``"auto"``, unless
            ``lanes > 1``); ``True`` where it can (else :class:`~sparsecomm.errors.IncompatibleError` saying
            why); ``False``, a call per bucket.
        **hyper: hyper-parameters of the method and its compressor.
    """

    def __init__(self, process_group: Any = None, compressor: Any = None, transport: Any = "default", *,
                 method: Any = None, transport_kwargs: dict | None = None, warmup_steps: int = 0,
                 min_compress_size: int = 0, seed: int = 0, model: torch.nn.Module | None = None,
                 sparse_rows: str = "gather", verify_replicas_every: int = VERIFY_EVERY, lanes: int | None = None,
                 fuse: bool | None = None, **hyper: Any) -> None:
        who = "sparsecomm.ddp hook state"
        warmup_steps = check_int("warmup_steps", warmup_steps, low=0, what=who)
        min_compress_size = check_int("min_compress_size", min_compress_size, low=0, what=who)
        seed = check_seed("seed", seed, what=who)
        self.verify_replicas_every = check_verify_every(verify_replicas_every)
        check_lanes(lanes)
        check_fuse(fuse)
        # hyper-parameters
        self.compressor = compressor
        self.transport = transport
        self.method = method
        self.transport_kwargs = dict(transport_kwargs or {})
        self.warmup_steps = int(warmup_steps)
        self.min_compress_size = int(min_compress_size)
        self.seed = int(seed)
        self.sparse_rows = sparse_rows
        self.lanes = lanes
        self.fuse = fuse
        self.hyper = dict(hyper)
        # binding (never pickled)
        self.process_group = process_group
        self._bind(model)
        if model is not None:
            self.set_model(model)
        if self.pipeline.rank == 0:
            step_size.check(self.step_size_hint, [], "state.step_size_hint")

    def _bind(self, model: torch.nn.Module | None = None) -> None:
        """Build the pipeline, its lanes and its scheduler (at construction and at unpickling: a collective,
        the settings agreement included, then the lanes' process groups)."""
        self.pipeline = CommPipeline(self.compressor, self.transport, method=self.method,
                                     transport_kwargs=self.transport_kwargs or None,
                                     fabric=default_fabric(self.process_group), seed=self.seed,
                                     warmup_steps=self.warmup_steps, sparse_rows=self.sparse_rows, **self.hyper)
        fused = resolve_fuse(self.fuse, self.pipeline, self.lanes)
        count = 1 if fused else resolve_lanes(self.lanes, self.pipeline, _buckets(model))
        self._agree(count, fused)
        self.scheduler = HookScheduler(self.pipeline, self.min_compress_size, self._verify, self._note_error,
                                       on_step_every=self.verify_replicas_every,
                                       lanes=Lanes(self.pipeline, count) if count > 1 else None, fused=fused)
        self._checked: list[tuple[str, torch.Tensor]] = []     # what the replica guard compares
        #: the library error that failed a bucket's communication (DDP's backward re-raises it as a
        #: ``RuntimeError`` whose text names it: torch's C++ layer keeps only the text), else None
        self.error: BaseException | None = None

    def set_model(self, model: torch.nn.Module) -> None:
        """Key the method state by the names of ``model``'s parameters (see the module doc); the replica
        guard checks its parameters that require grad."""
        self.scheduler.names = {id(p): n for n, p in model.named_parameters()}
        self._checked = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    @property
    def param_names(self) -> dict[int, str]:
        """Parameter id -> name, the names that key the method state (:meth:`set_model`)."""
        return self.scheduler.names

    @property
    def steps(self) -> int:
        """Steps (DDP iterations: backward passes) the hook has completed."""
        return self.scheduler.steps

    @property
    def step_size_hint(self) -> step_size.StepSizeHint:
        """What theory says about the step size of this method (:mod:`sparsecomm.pipeline.step_size`), at
        the sizes of the model's parameters (:meth:`set_model`; unknown without it)."""
        sizes = [p.numel() for _, p in self._checked if p.numel() >= self.min_compress_size]
        return step_size.hint(self.pipeline.method, self.pipeline.world_size, sizes)

    def bucket_key(self, params: list[torch.Tensor], index: int) -> Any:
        """The state key of a bucket holding ``params``: a digest of their names (else the index)."""
        return self.scheduler.key(params, index)

    def _agree(self, lanes: int, fused: bool) -> None:
        """Check, on every worker, that every worker built its hook state with the same settings, ``lanes``
        and ``fuse`` (what the rules resolved) included (:func:`sparsecomm.pipeline.settings.agree`: a
        collective, at construction and at unpickling, before the lanes' groups are created)."""
        agree(self.pipeline.fabric, "sparsecomm.ddp hook state", self.pipeline.settings() + [
            ("min_compress_size", repr(self.min_compress_size)),
            ("verify_replicas_every", repr(self.verify_replicas_every)), ("lanes", repr(lanes)),
            ("fuse", repr(fused))])

    @property
    def fused(self) -> bool:
        """Whether a step's dense buckets run as one call (the ``fuse`` rule's answer)."""
        return self.scheduler.fused

    @property
    def lane_count(self) -> int:
        """How many lanes the buckets run on (the ``lanes`` rule's answer)."""
        lanes = self.scheduler.lanes
        return 1 if lanes is None else lanes.count

    @property
    def verify_replicas_every(self) -> int:
        """Compare the workers' parameters at the start of every N-th step (0: never)."""
        return self._verify_every

    @verify_replicas_every.setter
    def verify_replicas_every(self, every: int) -> None:
        self._verify_every = every
        scheduler = self.__dict__.get("scheduler")
        if scheduler is not None:
            scheduler.on_step_every = every     # (the scheduler calls the guard at those steps only)

    def _verify(self, steps: int) -> None:
        """The replica guard, at the start of every ``verify_replicas_every``-th step."""
        every = self.verify_replicas_every
        if every and steps and steps % every == 0 and self._checked:
            verify_replicas(self.pipeline.fabric, self._checked, when=f"at step {steps}")

    # ---------------------------------------------------------------- accessors
    @property
    def last_stats(self) -> CommStats:
        """The last step's CommStats summed over buckets (so far, during a step)."""
        return self.pipeline.last_stats

    @property
    def iter(self) -> int:
        """Deprecated name of :attr:`steps` (torch's ``PowerSGDState.iter``)."""
        warn_renamed("CommHookState.iter", "CommHookState.steps")
        return self.steps

    def compression_stats(self) -> dict[str, float]:
        """Cumulative bytes before/after compression and their ``compression_factor`` (declared), the
        transport's counters with the factor measured on the wire (``compression_factor_sent``,
        ``sent_over_declared``: :meth:`~sparsecomm.pipeline.accounting.CompressionStats.as_dict`), and
        ``steps``, as the optimizer's (``iterations``: its deprecated name)."""
        d = self.pipeline.stats.as_dict()
        d["steps"] = self.steps
        return d

    # ---------------------------------------------------------------- hook body
    def reduce_bucket(self, buffer: torch.Tensor, index: int, is_last: bool,
                      params: list[torch.Tensor] | None = None, shapes: Any = None) -> torch.Tensor:
        """The bucket's average, synchronously (``start_bucket(...).wait()``; ``buffer``, ``index``,
        ``is_last``, ``params`` and ``shapes`` as for :meth:`start_bucket`)."""
        return self.start_bucket(buffer, index, is_last, params, shapes).wait()

    def start_bucket(self, buffer: torch.Tensor, index: int, is_last: bool,
                     params: list[torch.Tensor] | None = None, shapes: Any = None) -> CommWork:
        """Encode the bucket now and start its communication; ``wait()`` gives the average, shaped
        and typed as ``buffer`` (a sparse buffer gives the coalesced sparse average):
        :meth:`HookScheduler.start <sparsecomm.pipeline.scheduler.HookScheduler.start>`.

        Args:
            buffer: the bucket's flat local gradients (DDP's ``bucket.buffer()``).
            index: DDP's bucket index.
            is_last: whether it is the step's last bucket.
            params: the parameters the bucket holds (they key the method state).
            shapes: their gradients' shapes, for a method that reads them (PowerSGD).
        """
        return self.scheduler.start(buffer, index, is_last, params, shapes)

    def _note_error(self, exc: BaseException) -> None:
        """The scheduler's report of a bucket's failed communication (kept for the hook's report)."""
        self.error = exc

    # ---------------------------------------------------------------- checkpoints / pickling
    def state_dict(self) -> dict[str, Any]:
        """The internal state to checkpoint: the pipeline's (method states per parameter or bucket,
        generators) and :attr:`steps`."""
        return {"pipeline": self.pipeline.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (into this or a freshly built state; any bucket layout).

        Args:
            state: what :meth:`state_dict` returned.
        """
        self.pipeline.load_state_dict(state["pipeline"])
        self.scheduler.restart(int(state["steps"] if "steps" in state else state["iter"]))  # ("iter": older)

    def __getstate__(self) -> dict[str, Any]:
        return {"hyper": {k: getattr(self, k) for k in _HYPER}, "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        # (defaults of the options a state pickled by an older version lacks)
        self.verify_replicas_every, self.sparse_rows, self.lanes, self.fuse = VERIFY_EVERY, "gather", None, None
        for k, v in d["hyper"].items():
            setattr(self, k, v)
        self.process_group = None          # rebinds to the default process group
        self._bind()
        self.load_state_dict(d["state"])


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A ``register_comm_hook`` hook: the bucket's gradients averaged through the method and transport;
    returns a pending future that completes when the bucket's communication does.

    Args:
        state: the :class:`CommHookState` given to ``register_comm_hook``.
        bucket: DDP's ``GradBucket``.
    """
    buffer, index, is_last = bucket.buffer(), bucket.index(), bucket.is_last()
    fut = state.scheduler.chained(buffer, index, is_last)
    if fut is not None:
        return fut
    shapes = [g.shape for g in bucket.gradients()] if state.pipeline.method.uses_shapes else None
    work = state.start_bucket(buffer, index, is_last, bucket.parameters(), shapes)
    return work.get_future()


# DDP validates the hook's annotations as objects (this module's are strings under PEP 563)
comm_hook.__annotations__.update(state=CommHookState, bucket=dist.GradBucket,
                                 **{"return": torch.futures.Future[torch.Tensor]})


def _buckets(model: torch.nn.Module | None) -> int | None:
    """How many buckets DDP makes of ``model``'s gradients once it has rebuilt them (None: not a DDP model):
    DDP fills buckets in the reverse order of the parameters, the first up to ``dist._DEFAULT_FIRST_BUCKET_BYTES``
    (1 MiB), the others up to its ``bucket_bytes_cap``, each closed once it reaches its cap."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    cap = int(model.bucket_bytes_cap)
    limit = min(cap, int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)))
    closed, size = 0, 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        size += p.numel() * p.element_size()
        if size >= limit:
            closed, size, limit = closed + 1, 0, cap
    return closed + (size > 0)


def _job_ranks(group: Any) -> list[int] | None:
    """The job ranks of a process group's members (``None`` for anything that is not a group)."""
    return dist.get_process_group_ranks(group) if isinstance(group, dist.ProcessGroup) else None


def register(model: torch.nn.parallel.DistributedDataParallel, process_group: Any = None,
             **options: Any) -> CommHookState:
    """``model.register_comm_hook(CommHookState(process_group, **options), comm_hook)``; returns the state.

    Under :func:`sparsecomm.launch` with services (``"switch"``, ``"sparse-switch"``, dedicated
    OmniReduce aggregators) the default process group also holds the service ranks, which never join
    DDP's own collectives (its construction, bucket rebuild and buffer broadcasts would wait for them
    until the timeout): build DDP over the workers' group,
    ``DistributedDataParallel(net, process_group=ctx.fabric.native_group)``. A model over a group that
    holds a service rank is refused here with that advice (:class:`IncompatibleError`).

    ``process_group``: ``None`` (the default) takes the model's own group (``model.process_group``), so
    the hook averages over the ranks DDP runs over (a subgroup: see "Process groups" in the module
    doc); a group with other members than the model's is refused (:class:`IncompatibleError`), and a
    rank outside the group gets :class:`~sparsecomm.errors.InvalidValueError`.

    ``model`` must be a :class:`~torch.nn.parallel.DistributedDataParallel` (the hook is DDP's): anything
    else raises :class:`~sparsecomm.errors.InvalidTypeError` before any communication.

    Args:
        model: the ``DistributedDataParallel`` model.
        process_group: as for :class:`CommHookState`.
        **options: the keywords of :class:`CommHookState` (``compressor``, ``method``, ``transport``,
            ``ratio``, ...); ``model=`` is this model.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidTypeError(
            f"sparsecomm.ddp.register installs a DDP communication hook, so it needs a model wrapped in "
            f"torch.nn.parallel.DistributedDataParallel; got a {type(model).__name__}. Wrap it first "
            f"(net = DistributedDataParallel(model); sparsecomm.ddp.register(net, ...)), or use "
            f"sparsecomm.DistributedOptimizer(optimizer, ...) on the bare model")
    from .launch import current_context

    group = getattr(model, "process_group", None)
    model_ranks = _job_ranks(group)
    if process_group is None:
        process_group = group
    elif model_ranks is not None and _job_ranks(process_group) not in (None, model_ranks):
        raise IncompatibleError(
            f"sparsecomm.ddp.register: the DDP model runs its collectives over job ranks {model_ranks}, but "
            f"process_group has job ranks {_job_ranks(process_group)}; the hook must average over the "
            f"model's own group: pass the process_group the model was built with (or none: the model's)")
    ctx = current_context()
    services = sorted(set(ctx.fabric.services().values()) & set(model_ranks or ())) if ctx is not None else []
    if services:
        raise IncompatibleError(
            f"sparsecomm.ddp.register: this DDP model runs its own collectives over a process group of "
            f"{len(model_ranks)} ranks that holds the service rank(s) {services}, which never join them "
            f"(DDP would wait for them until the timeout); build DDP over the workers' group: "
            f"DistributedDataParallel(model, process_group=ctx.fabric.native_group)")
    state = CommHookState(process_group, model=model, **options)
    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse and not state.pipeline.plain:
        raise IncompatibleError(sparse_message(state.pipeline) + f" (sparse modules: {', '.join(sparse)})")
    model.register_comm_hook(state, comm_hook)
    return state
