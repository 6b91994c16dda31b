"""The bucket schedulers: which bucket goes through the pipeline when, under which key, in which step.

:class:`BucketScheduler` (owned by :class:`~sparsecomm.optim.DistributedOptimizer`; the rules are in
:mod:`sparsecomm.optim`, "Step", "Overlap" and "Sparse gradients"): the optimizer's buckets
(:mod:`sparsecomm.pipeline.buckets`, rebuilt when the parameters change), the agreement on the
sparse-gradient parameters at the first synchronisation, the post-accumulate-grad hooks that start each
complete bucket in the one fixed order during backward, and :meth:`BucketScheduler.synchronize`, which
starts what is left, waits and scatters the estimates into ``p.grad``.

:class:`HookScheduler` (owned by the DDP hook's :class:`~sparsecomm.ddp.CommHookState`; the rules are in
:mod:`sparsecomm.ddp`): DDP makes the buckets; the scheduler brackets DDP's iterations into the
pipeline's steps, keys each bucket's method state by its parameters' names (so that nothing depends on
DDP's layout), runs a one-round method per parameter or binds the bucket's state to its parameters,
and averages step 0 and small buckets uncompressed.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from typing import Any, Callable

import torch

from ..errors import IncompatibleError, InvalidValueError, MismatchError, SparseCommError
from ..fabric.engine import CommWork
from .buckets import Bucket, layout
from .core import CommPipeline
from .lanes import Lanes


class BucketScheduler:
    """The buckets of ``optimizer``'s parameters that require grad (:meth:`params`): at most
    ``cap_bytes`` each, parameters below ``min_compress`` elements in uncompressed buckets; with
    ``overlap``, a bucket starts as soon as each of its parameters has had ``passes`` gradients
    accumulated."""

    def __init__(self, pipeline: CommPipeline, optimizer: torch.optim.Optimizer, cap_bytes: int,
                 min_compress: int, overlap: bool, passes: int) -> None:
        self.pipeline, self.optimizer = pipeline, optimizer
        self.cap_bytes, self.min_compress, self.overlap, self.passes = cap_bytes, min_compress, overlap, passes
        #: synchronisations so far
        self.steps = 0
        #: whether the gradients were synchronised since the last inner step (``synchronize()`` called)
        self.synced = False
        #: ids of the parameters with sparse gradients (agreed at the first synchronisation; None before)
        self.sparse: frozenset[int] | None = None
        self._buckets: list[Bucket] | None = None
        self._param_ids: tuple[int, ...] = ()
        self._order: list[Bucket] = []                   # start order: the layout reversed
        self._bucket_of: dict[int, Bucket] = {}
        self._hooks: list[Any] = []
        self._next = 0                                   # next bucket to start in that order
        self._works: list[tuple[Bucket, CommWork]] = []
        self._fired: dict[int, int] = {}
        self._in_step = False
        #: whether the last synchronisation was skipped on every worker (``nonfinite="skip"``: a round had a
        #: non-finite sum; the method states and generators are as before it, the gradients hold NaN)
        self.skipped = False

    # ------------------------------------------------------------------ layout
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters that require grad, in ``param_groups`` order (read anew: groups may change)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def layout(self) -> list[Bucket]:
        """The buckets of the current parameters (rebuilt, with the method state reset and a warning,
        when they changed)."""
        params = self.params()
        if self._buckets is None or tuple(id(p) for p in params) != self._param_ids:
            if self._buckets is not None:
                warnings.warn("DistributedOptimizer: the parameters changed; the buckets are rebuilt and "
                              "the method state is reset", RuntimeWarning, stacklevel=4)
                self.pipeline.states.reset()
                self.sparse = None
            self._build(params)
        return self._buckets  # type: ignore[return-value]

    def _build(self, params: list[torch.nn.Parameter]) -> None:
        self._buckets = layout(params, self.cap_bytes, self.min_compress, self.sparse or frozenset())
        self._param_ids = tuple(id(p) for p in params)
        self._order = list(reversed(self._buckets))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.overlap:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.grad_ready))

    def signature(self) -> list[tuple[int, str, bool]]:
        """``(numel, dtype, compressed)`` of every bucket (what a checkpoint must match)."""
        return [(b.numel, str(b.dtype), b.compress) for b in self.layout()]

    def sparse_indices(self) -> list[int] | None:
        """The indices (in ``params()``) of the sparse-gradient parameters, None before the agreement."""
        if self.sparse is None:
            return None
        return [i for i, p in enumerate(self.params()) if id(p) in self.sparse]

    def restore_sparse(self, indices: list[int]) -> None:
        """Take a checkpoint's sparse-gradient parameters (``indices`` in ``params()``) as agreed."""
        params = self.params()
        if any(not 0 <= i < len(params) for i in indices):
            raise MismatchError(f"the checkpoint's sparse-gradient parameters {indices} do not exist here "
                                f"({len(params)} parameters)")
        want = frozenset(id(params[i]) for i in indices)
        if want != (self.sparse or frozenset()) or self.sparse is None:
            self.sparse = want
            self._build(params)

    def _agree_sparse(self) -> None:
        """First synchronisation: agree on the parameters with sparse gradients; rebuild the layout if
        there are any (each gets a bucket of its own)."""
        params = self.params()
        flags = torch.tensor([1.0 if p.grad is not None and p.grad.is_sparse else 0.0 for p in params],
                             dtype=torch.float32)
        if self.pipeline.world_size > 1 and flags.numel():
            flags = self.pipeline.transport.allreduce(flags)
        self.sparse = frozenset(id(p) for p, f in zip(params, flags.tolist()) if f > 0)
        if self.sparse:
            if self.pipeline.states.keys():
                raise MismatchError("the method has state for a layout without the sparse-gradient "
                                    "buckets (a checkpoint loaded before the first step); load it after one step")
            self._build(params)

    # ------------------------------------------------------------------ rounds
    @property
    def in_flight(self) -> int:
        """Buckets started and not yet waited for."""
        return len(self._works)

    def grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: start every bucket that is complete, in the fixed order."""
        if self.sparse is None or self.synced:
            return    # the first step (sparse gradients not agreed yet), or a backward after synchronize()
        n = self._fired.get(id(p), 0) + 1
        self._fired[id(p)] = n
        if n > self.passes:
            raise SparseCommError(
                f"a gradient was accumulated {n} times before step() but backward_passes_per_step="
                f"{self.passes}: its bucket was already started with the first gradient. Pass "
                f"backward_passes_per_step={n} (gradient accumulation) or overlap=False")
        if n != self.passes:
            return
        b = self._bucket_of.get(id(p))
        if b is None:
            return
        b.ready += 1
        with torch.no_grad():
            while self._next < len(self._order):
                nb = self._order[self._next]
                if nb.ready < len(nb.params):
                    break
                self._start(nb)

    def _start(self, b: Bucket) -> None:
        pipe = self.pipeline
        if not self._in_step:
            pipe.begin_step(self.steps + 1)        # the identity of this step's calls carries our counter
            self._in_step = True
        if b.sparse and pipe.plain:
            p = b.params[0]
            work = pipe.start_sparse(p.grad, p.shape, b.key, p.dtype)
        else:
            flat = b.gather()
            # (the gather writes every byte of the bucket: a fabric that models the hosts charges it as a copy,
            # as the DDP hook's concatenation is charged)
            if pipe.fabric.charges_host_work:
                pipe.fabric.host_work("copy", flat.nbytes)
            work = pipe.start(flat, b.key, compress=b.compress, shapes=b.shapes)
        self._works.append((b, work))
        self._next += 1

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the gradients over workers now: start the buckets not started yet (in the fixed
        order), wait for all of them and write the estimates into ``p.grad``; then end the pipeline's
        step (:meth:`CommPipeline.end_step <sparsecomm.pipeline.core.CommPipeline.end_step>`, whose answer
        is :attr:`skipped`)."""
        self.skipped = False
        if self.sparse is None:
            self.layout()
            self._agree_sparse()
        self.layout()
        try:
            while self._next < len(self._order):
                self._start(self._order[self._next])
            sparse = self.sparse or frozenset()
            for b, work in self._works:
                est = work.wait()
                if b.sparse and self.pipeline.plain:
                    b.params[0].grad = est
                else:
                    b.scatter(est, sparse)
        finally:
            self._reset_round()
            self.skipped = self.pipeline.end_step()
        self.steps += 1
        self.synced = True

    def _reset_round(self) -> None:
        for b in self._order:
            b.ready = 0
        self._works = []
        self._next = 0
        self._fired = {}
        self._in_step = False

    def clear_ready(self) -> None:
        """Forget the gradients counted so far (``zero_grad()``; nothing may be in flight)."""
        if self._works:
            raise SparseCommError(
                f"zero_grad() with {len(self._works)} bucket(s) in flight (started by backward): call "
                f"step() or synchronize() first, so that every worker completes the same rounds")
        self._fired = {}
        for b in self._order:
            b.ready = 0
        self.synced = False


class HookScheduler:
    """The DDP hook's buckets through ``pipeline`` (see the module doc): :meth:`start` is the hook's body.
    ``on_step(steps)`` runs at the first bucket of every step whose count ``steps`` (the steps completed
    before it) is a multiple of :attr:`on_step_every`, before the step begins (the replica guard);
    ``on_error(exc)`` when a bucket's communication failed (on the thread that completed it, or on the
    calling thread where its collective could not be posted). ``lanes``: bucket ``k`` runs on lane
    ``lanes.of(k)``, every call's outcome decided in call order (:mod:`sparsecomm.pipeline.lanes`; None or one
    lane: every call on the pipeline's fabric, chained where the pipeline chains it)."""

    def __init__(self, pipeline: CommPipeline, min_compress_size: int,
                 on_step: Callable[[int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, on_step_every: int = 1,
                 lanes: Lanes | None = None, fused: bool = False) -> None:
        self.pipeline, self.min_compress_size, self.on_step = pipeline, min_compress_size, on_step
        #: the lanes the buckets run on (None: one)
        self.lanes = lanes if lanes is not None and lanes.count > 1 else None
        self.on_error = on_error
        #: ``on_step`` runs at the steps whose count is a multiple of this (0: never)
        self.on_step_every = int(on_step_every)
        #: steps (DDP iterations: backward passes) completed
        self.steps = 0
        #: parameter id -> name (the model's names, which key the method state)
        self.names: dict[int, str] = {}
        self._in_step = False
        # the calls of the step in progress not yet complete, and whether its last bucket was started: the
        # step ends (CommPipeline.end_step) when both say it is over, before DDP sees the last result
        self._lock = threading.Lock()
        self._pending = 0
        self._last_started = False
        # whether a compressed bucket is keyed by its index (as chained() keys every bucket), and whether its
        # rounds run per parameter
        pipe = pipeline
        self._per_parameter = pipe.per_parameter
        self._by_index = not (self._per_parameter or pipe.method.State is not None or pipe.warmup_steps)
        # the key, segments and shapes of each bucket's parameters keyed by their names (by the parameters' ids,
        # for the names of _layouts_names): the same objects at every step (StateStore.bind's steady state)
        self._layouts: dict[tuple[int, ...], tuple[Any, tuple, tuple]] = {}
        self._layouts_names: dict[int, str] | None = None
        #: whether a step's dense buckets run as one call (see :meth:`start`)
        self.fused = bool(fused)
        # the dense buckets of the step in progress held for the fused call: (buffer, index, its work, its
        # parameters' sizes or None)
        self._held: list[tuple[torch.Tensor, int, CommWork, tuple[int, ...] | None]] = []

    def restart(self, steps: int) -> None:
        """Continue from a checkpoint taken after ``steps`` steps (none in progress)."""
        self.steps, self._in_step = int(steps), False
        self._pending, self._last_started = 0, False
        self._held = []

    def _track(self, work: CommWork, is_last: bool) -> CommWork:
        """Count ``work`` among the step's calls; the last one to complete, once the step's last bucket is
        started, ends the pipeline's step (commit, or roll back a skipped step: :meth:`CommPipeline.end_step
        <sparsecomm.pipeline.core.CommPipeline.end_step>`) before its own result is handed on."""
        with self._lock:
            self._pending += 1
            if is_last:
                self._last_started = True
        work.add_done_callback(self._completed)
        return work

    def _completed(self, work: CommWork) -> None:
        self._settle(None, work.exception())

    def _settle(self, value: Any, exc: BaseException | None) -> None:
        """A call of the step completed (with ``exc``, its error, or None): see :meth:`_track`."""
        if exc is not None and self.on_error is not None:
            self.on_error(exc)
        with self._lock:
            self._pending -= 1
            over = self._last_started and self._pending == 0
            if over:
                self._last_started = False
        if over:
            self.pipeline.end_step()

    def key(self, params: list[torch.Tensor], index: int) -> Any:
        """The state key of a bucket holding ``params``: a digest of their names (else the index)."""
        names = [self.names.get(id(p)) for p in params]
        if not params or any(n is None for n in names):
            if self.pipeline.states.keyed_by_names():
                raise MismatchError("this hook state holds method state keyed by parameter names but does "
                                    "not know the model's names: call state.set_model(ddp_model) after "
                                    "unpickling it or building it without model=")
            return index
        return "p:" + hashlib.blake2b("\x00".join(names).encode(), digest_size=8).hexdigest()

    def _layout(self, params: list[torch.Tensor], index: int) -> tuple[Any, tuple | None, tuple | None]:
        """``(key, segments, shapes)`` of a bucket holding ``params``: :meth:`key`, and where it is a digest of
        their names, their ``(name, numel)`` and their shapes, kept per parameter ids (for these names)."""
        names = self.names
        if self._layouts_names is not names:
            self._layouts, self._layouts_names = {}, names
        ids = tuple(map(id, params))
        hit = self._layouts.get(ids)
        if hit is not None:
            return hit
        key = self.key(params, index)
        if key == index:
            return key, None, None
        hit = self._layouts[ids] = (key, tuple((names[id(p)], p.numel()) for p in params),
                                    tuple(p.shape for p in params))
        return hit

    def _begin(self) -> None:
        """At the first bucket of a step: ``on_step`` (where due), then the pipeline's step."""
        if not self._in_step:
            every = self.on_step_every
            if self.on_step is not None and every and self.steps % every == 0:
                self.on_step(self.steps)
            self.pipeline.begin_step(self.steps + 1)   # the identity of this step's calls carries our counter
            self._in_step = True

    def chained(self, buffer: torch.Tensor, index: int, is_last: bool) -> "torch.futures.Future | None":
        """DDP's bucket ``index`` averaged as :meth:`start` would (the same key, call, checks, records
        and step), its completion chained on its collective where the pipeline chains it
        (:meth:`CommPipeline.chain <sparsecomm.pipeline.core.CommPipeline.chain>`: the plain average, in
        ``buffer`` itself, and the fp16/bf16 casts' round): a future of the average; or None when
        nothing was done (a sparse bucket, another method, an unpredicted plain call, ...): then
        :meth:`start` it. The step's bookkeeping (:meth:`_track`) is the same."""
        if buffer.is_sparse or buffer.ndim != 1 or not buffer.is_contiguous() or self.lanes is not None \
                or self.fused:
            return None
        least = self.min_compress_size
        compress = self.steps >= 1 and (not least or buffer.numel() >= least)
        if compress and not self._by_index:
            return None
        if not self._in_step:      # (_begin, inline: one call less at every step)
            every = self.on_step_every
            if self.on_step is not None and every and self.steps % every == 0:
                self.on_step(self.steps)
            self.pipeline.begin_step(self.steps + 1)
            self._in_step = True
        with self._lock:
            self._pending += 1
            last_before, self._last_started = self._last_started, self._last_started or is_last
        fut, failed = None, True
        try:
            fut = self.pipeline.chain(buffer, index, compress=compress, done=self._settle)
            if isinstance(fut, CommWork):        # (encoded, then started: tracked as start() tracks it)
                fut.add_done_callback(self._completed)
                fut = fut.get_future()
            failed = False
        except BaseException as exc:
            if self.on_error is not None:       # (its collective could not be posted: CommEngine.chain)
                self.on_error(exc)
            raise
        finally:
            if fut is None:
                with self._lock:
                    self._pending -= 1
                    self._last_started = last_before
            if is_last and (fut is not None or failed):    # (else start() ends the step's bucket count)
                self.steps += 1
                self._in_step = False
        return fut

    def start(self, buffer: torch.Tensor, index: int, is_last: bool, params: list[torch.Tensor] | None = None,
              shapes: Any = None) -> CommWork:
        """Encode DDP's bucket ``index`` now and start its communication; ``wait()`` gives the average,
        shaped and typed as ``buffer`` (a sparse buffer gives the coalesced sparse average)."""
        pipe = self.pipeline
        self._begin()
        try:
            if self.fused:
                if not buffer.is_sparse:
                    return self._hold(buffer, index, is_last, params)
                if self._held:          # (a sparse bucket between dense ones: theirs is one call, started first)
                    self._release(False)
            if buffer.is_sparse:
                if not pipe.plain:
                    raise IncompatibleError(sparse_message(pipe))
                return self._track(self._ordered(pipe.start_sparse(buffer, buffer.shape, index), 0), is_last)
            flat = buffer if buffer.dim() == 1 else buffer.reshape(-1)
            compress = self.steps >= 1 and flat.numel() >= self.min_compress_size
            key, segments = index, None
            if params is not None and compress and not self._by_index:
                # method state to key by the parameters: a typed state, or a round count that warm-up reads
                # (a stateless bucket-wide round without warm-up keeps the index)
                key, segs, param_shapes = self._layout(params, index)
                if key != index:
                    if self._per_parameter:
                        segments = segs          # state, generator and step per parameter
                    else:
                        pipe.states.bind(key, segs, param_shapes)
            shape, dtype = buffer.shape, buffer.dtype
            # DDP's buckets are flat: the estimate has the buffer's shape and dtype
            then = None if buffer.dim() == 1 else (lambda est: est.to(dtype).reshape(shape))
            lane = 0 if self.lanes is None else self.lanes.of(index)
            return self._track(self._ordered(pipe.start(flat, key, compress=compress, shapes=shapes,
                                                        segments=segments, then=then, lane=lane), lane), is_last)
        finally:
            if is_last:
                self.steps += 1
                self._in_step = False

    def _hold(self, buffer: torch.Tensor, index: int, is_last: bool,
              params: list[torch.Tensor] | None = None) -> CommWork:
        """The fused step (:attr:`fused`, a plain average): DDP's dense bucket ``index`` held, its work pending,
        until the step's last bucket (or a sparse one); then the held buckets run as one call (keyed by the first
        one's index: :meth:`_release`), whose average completes each bucket's work. A bucket of another dtype than
        the held ones starts theirs first (one call per run of one dtype). Every worker holds the same buckets
        (DDP calls the hook for them in index order on every rank), so the calls match. ``params``: the bucket's
        parameters (DDP's ``bucket.parameters()``), whose sizes place it on the transport's block grid."""
        if self._held and self._held[0][0].dtype != buffer.dtype:
            self._release(False)
        work = CommWork()
        self._held.append((buffer, index, work, None if params is None else tuple(p.numel() for p in params)))
        if is_last:
            self._release(True)
        return work

    def _release(self, is_last: bool) -> None:
        """Start the held buckets' one call (see :meth:`_hold`); its outcome completes each bucket's work.

        The call's input is a single bucket itself, or the buckets copied one after another, each where
        :func:`grid_starts` places it on the transport's :attr:`~sparsecomm.transports.base.Transport.block_grid`
        (zeros between them), so that a block-sparse transport sees each bucket's largest parameter as the
        optimizer's layout would: a row that is zero on every worker fills whole blocks, which never travel, where
        DDP's offsets would cut it across two. (A single bucket is not copied onto the grid: the copy, a pass over
        the whole gradient on the training's cores, costs about what it saves at 1 Gbit/s, and more on a faster
        link.) Its average completes each bucket's work with that bucket's part, given to DDP as it stands (a
        tensor whose storage starts at the part: DDP reads a hook's result at its bucket offsets from its
        storage's start, then copies it into the gradients), or, off the CPU, copied into the bucket's own
        buffer."""
        held, self._held = self._held, []
        bufs = [b.reshape(-1) for b, _, _, _ in held]
        fabric = self.pipeline.fabric
        nbytes = sum(b.nbytes for b in bufs)
        try:
            if len(bufs) == 1:
                starts, flat = [0], bufs[0]
            else:       # (scratch: the call may write into it)
                starts, total = grid_starts([(b.numel(), sizes) for b, (_, _, _, sizes) in zip(bufs, held)],
                                            self.pipeline.transport.block_grid)
                flat = torch.empty(total, dtype=bufs[0].dtype, device=bufs[0].device)
                end = 0
                for b, at in zip(bufs, starts):
                    if at > end:
                        flat[end: at].zero_()
                    flat[at: at + b.numel()].copy_(b)
                    end = at + b.numel()
                fabric.host_work("copy", nbytes)        # (a fabric that models the hosts charges the copy)
            call = self._track(self.pipeline.start(flat, held[0][1], compress=False, dense_bytes=nbytes), is_last)
        except BaseException as exc:
            for _, _, work, _ in held:
                work.complete(None, exc)
            raise

        def split(done: CommWork) -> None:
            exc = done.exception()
            if exc is not None:
                for _, _, work, _ in held:
                    work.complete(None, exc)
                return
            est = done.wait().reshape(-1)
            for (buffer, _, work, _), at in zip(held, starts):
                n = buffer.numel()
                part = est[at: at + n]
                if part.data_ptr() == buffer.data_ptr():
                    work.complete(buffer, None)
                elif part.dtype == buffer.dtype and part.storage_offset() == 0:
                    work.complete(part.view(buffer.shape), None)
                elif part.dtype == buffer.dtype and part.is_cpu:
                    # (the same memory as a tensor of its own storage: its bytes through numpy, which has no
                    # bfloat16)
                    own = torch.from_numpy(part.view(torch.uint8).numpy()).view(part.dtype)
                    work.complete(own.view(buffer.shape), None)
                else:
                    buffer.view(n).copy_(part)
                    fabric.host_work("copy", part.nbytes)
                    work.complete(buffer, None)

        call.add_done_callback(split)

    def _ordered(self, work: CommWork, lane: int) -> CommWork:
        """``work`` (a call on ``lane``) in the call order of the lanes, where there are several."""
        return work if self.lanes is None else self.lanes.ordered(work, lane)


def grid_starts(buckets: list[tuple[int, tuple[int, ...] | None]], grid: int) -> tuple[list[int], int]:
    """Where the fused call's input holds each bucket, and its length: ``buckets`` as ``(numel, sizes)`` (the sizes
    of its parameters, in order, or None), one after another, each starting at the first place at or after the
    previous one's end where its largest parameter (the first of equal ones) starts on a multiple of ``grid``
    (a bucket without sizes, or a ``grid`` of 1: right after the previous one). Every worker places alike (the
    same buckets and sizes).

    DDP's two buckets of an MLP 64-1024-1024-10 (its parameters in reverse order), on OmniReduce's 256:

    >>> grid_starts([(1059850, (10, 10240, 1024, 1048576)), (66560, (1024, 65536))], 256)
    ([246, 1060096], 1126656)
    """
    starts, end = [], 0
    for numel, sizes in buckets:
        at = end
        if grid > 1 and sizes:
            big = max(range(len(sizes)), key=sizes.__getitem__)
            at += (-(end + sum(sizes[:big]))) % grid
        starts.append(at)
        end = at + numel
    return starts, end


def check_fuse(requested: Any) -> None:
    """:class:`~sparsecomm.errors.InvalidValueError` unless ``requested`` is None or a bool."""
    if requested is not None and not isinstance(requested, bool):
        raise InvalidValueError(f"fuse must be None (the default rule), True or False, got {requested!r}")


def why_not_fused(pipeline: CommPipeline, lanes: int | None) -> str | None:
    """Why the DDP hook's buckets cannot run as one call a step (the same on every worker), or None."""
    if not pipeline.plain:
        return (f"method {pipeline.method.name!r} with compressor {pipeline.method.compressor.name!r} compresses "
                f"each bucket (its numbers depend on the buckets); only plain averaging (compressor='none') fuses")
    if lanes is not None and lanes > 1:
        return f"lanes={lanes} runs the buckets' calls side by side; one call a step has none to overlap"
    return None


def resolve_fuse(requested: bool | None, pipeline: CommPipeline, lanes: int | None) -> bool:
    """Whether the DDP hook runs a step's dense buckets as one call (:meth:`HookScheduler._hold`).

    ``True`` where it can (:func:`why_not_fused`; else :class:`~sparsecomm.errors.IncompatibleError` saying why);
    ``False`` never; ``None``, the default rule: fused for plain averaging on a protocol of this library (any
    transport but ``native`` and ``"auto"``) unless ``lanes`` asks for lanes. Such a call pays a fixed cost
    before its data moves (an agreement handshake, a control round, a look-ahead) and its protocol runs on a
    communication thread beside the training thread, so on hosts whose cores the training keeps busy one call
    after backward costs less than a call per bucket overlapped with it (BENCHMARKS.md, "Time to accuracy on
    the netbed"), as :class:`~sparsecomm.DistributedOptimizer` runs the whole gradient. ``native`` posts each
    bucket to torch's own collective at once, as DDP does, and keeps a call per bucket."""
    check_fuse(requested)
    why = why_not_fused(pipeline, lanes)
    if requested is None:
        return why is None and pipeline.chooser is None and pipeline.transport.name != "native"
    if requested and why is not None:
        raise IncompatibleError(f"fuse=True: {why}; pass fuse=False (or None: the default rule)")
    return requested


def sparse_message(pipeline: CommPipeline) -> str:
    """Why the DDP hook refuses a sparse gradient bucket under a compressing method, and what to do."""
    t = pipeline.transport.name
    return (f"sparsecomm's DDP hook got a sparse gradient bucket (nn.Embedding(sparse=True)), which it "
            f"averages only plainly (compressor='none'); this hook has method "
            f"{pipeline.method.name!r} with compressor {pipeline.method.compressor.name!r} "
            f"on transport {t!r}. Use sparsecomm.ddp.register(model, compressor='none', "
            f"transport='omnireduce'), sparse=False embeddings, or sc.DistributedOptimizer (which "
            f"averages sparse gradients with any method and returns them sparse)")
