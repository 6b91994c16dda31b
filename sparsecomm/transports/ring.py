"""``ring``: bandwidth-optimal all-reduce by reduce-scatter then all-gather over the Fabric.

The flat vector is cut into ``n`` chunks (sizes differ by at most one element). In reduce-scatter step
``s = 0 .. n-2`` worker ``r`` sends its running sum of chunk ``(r - s) mod n`` to ``r + 1`` and adds the
chunk ``(r - s - 1) mod n`` received from ``r - 1``; after ``n - 1`` steps it holds the full sum of chunk
``(r + 1) mod n``. All-gather step ``s`` forwards chunk ``(r + 1 - s) mod n`` to the right and stores chunk
``(r - s) mod n`` from the left. Every worker sends and receives ``2 (n-1)/n`` of the data in
``2 (n-1)`` latency steps (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009); see :func:`theory.costs.ring_allreduce`. Before the data, a
:mod:`handshake <sparsecomm.transports._handshake>` checks that every worker passes the same length,
dtype, payload layout and segment size (``ceil(log2 n)`` small messages), as the first part of the same
role (:func:`~.linear.guarded_vector_role`, the ring role's prologue): one drive per call.

Chunks travel as pipelined segments (:func:`segment_length`): of ``segment_bytes`` if given; by default
of at most :data:`DEFAULT_SEGMENT_BYTES` (4 MiB), and of at most half the chunk when that half is at least
:data:`MIN_SEGMENT_BYTES` (1 MiB). Each segment is added (or stored) as it arrives and forwarded at once,
so additions overlap the transfers and the per-step latency is paid once per pipeline rather than per
chunk: a chunk in one piece is store-and-forward, and every step would pay, on top of its transfer, what
happens between the last byte in and the first byte out (the receiving thread's wake-up, the addition,
gloo's rendezvous, the links' last burst). The time per step on the netbed, in one piece and in
segments: BENCHMARKS.md, "SimFabric vs netbed" (``experiments/bench/ring_trace.py``). The all-gather's
receives are posted during the reduce-scatter, as soon as the regions they overwrite have been sent
(:func:`ring_allreduce_`). The two receive buffers (one chunk each) are kept by the transport object
between calls, so that no call pays the page faults of fresh buffers.

Written as one role (:mod:`sparsecomm.fabric.roles`: it yields its sends, the receives it posts and its
waits) that the fabric runs (``Fabric.drive``), so it runs on SimFabric and TorchFabric alike, on the
tensors' device (CUDA tensors over nccl). Its defaults (the segments above) are the real fabric's and the
SimFabric's alike: the cost model (:func:`theory.costs.ring_allreduce`) prices the same segments (:mod:`.defaults`).

Payloads it sums compactly, as their linear operand (:mod:`.linear`: the element-wise sum of one vector
per worker):

- ``dense``: the values, summed in the values' dtype (a float16 payload travels and is summed in
  float16, as an fp16 all-reduce does); the result is cast to the payload's dtype.
- ``aligned``: the value vectors (every worker has the same indices; a checksum of the indices is part
  of the handshake), scattered into the dense result at the shared indices.
- ``quantized`` with ``shared_scale``: the integer codes, summed exactly in the narrowest integer dtype
  that holds ``n`` times the largest code announced in the handshake (int8 for a majority vote of up
  to 127 workers' signs: 8 bits per element where the declared bits count 1, the unit of a partial
  sum; int16, int32, int64 beyond), then multiplied by the shared scale (its checksum is part of the
  handshake, so a scale that is not shared is a clear error rather than a wrong sum).

A repeated call skips its agreement handshake where the fabric keeps a record of the calls (real processes;
:mod:`._fold`, as ``native``'s): a float call every worker predicts from the same record runs its steps at once,
and a worker making another call joins the predicted one with NaN first, so the workers that skipped the
handshake find NaN in the sum and run it (``Ring._sum_linear``), where it meets the deviator's: the same
``MismatchError`` on every worker as without the skip. The SimFabric keeps no record: nothing changes there.

Values (:func:`~.linear.guarded_sum`, :mod:`._guards`): an integer input travels in its own dtype when
``n`` times the largest magnitude announced in the handshake fits it, else in the narrowest wider integer
dtype that holds the sum, and the sum is range-checked back (never wrapped); a float sum holding NaN/Inf
raises on every worker unless ``nonfinite="pass"``.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from ..errors import InvalidValueError
from ..fabric.base import Fabric
from ..fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step
from . import _fold
from ._guards import nonfinite_option
from ._handshake import check_agreement
from ..theory import costs
from .base import CallShape, Transport, registry
from .linear import LinearOperand, guarded_finish, guarded_sum, guarded_vector_role, linear_operand

RING_TAG = 0x5C10
#: the longest segment by default (the segment is the same on every worker: it is in the handshake)
DEFAULT_SEGMENT_BYTES = 4 << 20
#: by default, a chunk of at least twice this travels in at least two segments (:func:`segment_length`)
MIN_SEGMENT_BYTES = 1 << 20
#: the stage of each of the ring's waits (one role: no preference to state)
_STEP = Step()
#: builds a request from all its fields, in order (``_new(Send, (buf, dst, tag, hold, deferrable, stable))``): a
#: NamedTuple's own constructor is a Python function, a call per request of the ring's steps
_new = tuple.__new__
if (Send._fields, Recv._fields, PostInto._fields, Flush._fields) != (
        ("buf", "dst", "tag", "hold", "deferrable", "stable"), ("keys", "stage", "gone", "any", "free"),
        ("key", "buf", "src", "tag"), ("hold",)):
    raise ImportError("the ring builds its requests from their fields (_new): their fields have changed")


def chunk_bounds(numel: int, n: int) -> list[int]:
    """Boundaries of ``n`` contiguous chunks of sizes ``ceil`` / ``floor`` of ``numel / n``."""
    q, r = divmod(numel, n)
    return [i * q + min(i, r) for i in range(n + 1)]


def _chunk(c: int, q: int, rem: int) -> tuple[int, int]:
    """Chunk ``c``'s bounds when the vector is ``n q + rem`` long (``chunk_bounds(numel, n)[c:c + 2]``,
    without the list of every chunk's)."""
    lo = c * q + (c if c < rem else rem)
    return lo, lo + q + (1 if c < rem else 0)


def segment_length(chunk: int, segment: int | None, elem_size: int) -> int:
    """Elements per segment for chunks of at most ``chunk`` elements: ``segment`` if given (at most the
    chunk); by default (``None``) at most :data:`DEFAULT_SEGMENT_BYTES`, and at most half the chunk
    (rounded up) when that half is at least :data:`MIN_SEGMENT_BYTES`, so that every step's forwarding
    overlaps its own arrival instead of waiting for the whole chunk."""
    if segment is None:
        segment = max(1, DEFAULT_SEGMENT_BYTES // elem_size)
        half = -(-chunk // 2)
        if half * elem_size >= MIN_SEGMENT_BYTES:
            segment = min(segment, half)
    return max(1, min(int(segment), chunk))


#: the reduce-scatter's receive buffers (one chunk each) at most: its receives are posted up to this many
#: steps ahead, less one (:func:`rs_buffers`)
RS_BUFFERS = 4


def rs_buffers(n: int, chunk_bytes: int) -> int:
    """The reduce-scatter's receive buffers with ``n > 2`` workers and chunks of at most ``chunk_bytes``: two
    (a step's receives posted while the step before is summed), and up to :data:`RS_BUFFERS` while they hold at
    most :data:`DEFAULT_SEGMENT_BYTES` in all, at most one per step. Receives posted further ahead take a left
    neighbour's data that runs ahead of this worker at once: on a real fabric its send does not wait for them;
    on the SimFabric the send writes straight into the posted buffer rather than into a copy of its own (its
    loop runs a worker several steps ahead of its right neighbour at times)."""
    fit = DEFAULT_SEGMENT_BYTES // max(1, chunk_bytes)
    return max(2, min(RS_BUFFERS, n - 1, fit))


def _workspace(cache: dict | None, numel: int, count: int, like: torch.Tensor) -> list[torch.Tensor]:
    """``count`` buffers of ``numel`` elements like ``like``, reused across calls through ``cache``
    (fresh large allocations cost page faults on every call)."""
    key = (like.dtype, like.device)
    bufs = cache.get(key) if cache is not None else None
    if bufs is None or len(bufs) < count or bufs[0].numel() < numel:
        bufs = [torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(count)]
        if cache is not None:
            cache.clear()          # keep one workspace: the latest dtype/device
            cache[key] = bufs
    return [b[:numel] for b in bufs[:count]]


def ring_allreduce_(fabric: Fabric, acc: torch.Tensor, tag: int = RING_TAG,
                    segment: int | None = None, workspace: dict | None = None) -> torch.Tensor:
    """Sum the flat ``acc`` over the workers in place (reduce-scatter + all-gather); return it.

    Every worker must pass a vector of the same length and dtype and the same ``segment`` (check with
    the handshake first). Chunks longer than ``segment`` elements travel as segments that are pipelined:
    a worker adds (reduce-scatter) or stores (all-gather) each segment as it arrives and forwards it at
    once, so additions and transfers of consecutive segments overlap; the next step's receives are
    posted while the current one is processed (two receive buffers, kept in ``workspace`` if given), and the
    all-gather's receives during the reduce-scatter, each once the region it overwrites has been sent.
    Empty chunks are not sent. The steps are one role (:func:`ring_role`) that ``fabric.drive`` runs.
    """
    n = fabric.world_size
    if n == 1:
        return acc
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    fabric.drive([ring_role(fabric, acc, inbox, tag, segment, workspace)], inbox, outbox)
    outbox.finish()
    fabric.stats.rounds += 2 * (n - 1)
    return acc


def ring_role(fabric: Fabric, acc: torch.Tensor | None, inbox: Inbox, tag: int = RING_TAG,
              segment: int | None = None, workspace: dict | None = None, prologue=None, out: list | None = None):
    """The ring's steps on this worker (:func:`ring_allreduce_`) as one role (:mod:`sparsecomm.fabric.roles`):
    it yields its sends (each held under its index among this worker's sends, :class:`~.roles.Send`), the
    receives it posts into the workspace's buffers or into ``acc``, and a wait for each (:class:`~.roles.Recv`),
    then takes the message from ``inbox``; before an all-gather receive overwrites a region of ``acc`` it waits
    for the send of that region (:class:`~.roles.Flush`). ``fabric`` is read for its rank, world size,
    ``serial_pairs`` and ``charges_host_work`` (a summed segment is declared only where it is charged);
    ``tag``, ``segment``, ``workspace``: as :func:`ring_allreduce_`. It returns ``acc``.

    ``prologue``: a role run first, in this frame, that returns ``(vector, note)``: the vector to sum (``acc``
    is then not used; e.g. :func:`~.linear.guarded_vector_role`, the agreement handshake). The steps' requests
    then pass no frame around this one. ``out``: the sum is appended to it as ``(sum, note)`` (``note``
    ``False`` without a prologue)."""
    note = False
    if prologue is not None:
        acc, note = yield from prologue
    n, r = fabric.world_size, fabric.rank
    q, rem = divmod(acc.numel(), n)     # chunk c is _chunk(c, q, rem)
    big = q + (1 if rem else 0)         # the longest chunk's length (chunk 0's)
    seg = max(1, int(segment)) if segment else max(1, big)
    if n == 2 and getattr(fabric, "serial_pairs", False):
        # one ordered channel per pair (nccl): with two workers the left and right neighbours are the
        # same rank, so a forwarded segment would wait behind receives posted for later; no segments
        seg = max(1, big)
    right, left = (r + 1) % n, (r - 1) % n
    host_work, dtype = (fabric.host_work if fabric.charges_host_work else None), acc.dtype
    nbufs = 1 if n == 2 else rs_buffers(n, big * acc.element_size())
    bufs = _workspace(workspace, big, nbufs, acc)
    # per workspace buffer, the views of its segments for a chunk of q elements and of q + 1 (index 0 and 1): every
    # step's receives are posted into one of them, each list built at its first use
    views = [[None, None] for _ in range(nbufs)]
    # chunk c's view (one segment per chunk: every chunk's made at once), else its segments' slices of ``acc``
    chunks = acc.split([q + 1] * rem + [q] * (n - rem)) if seg >= big else None
    # the chunks' bounds and segments are computed where used (a list of them per worker is O(n^2) in all)
    clo, chi = _chunk(r, q, rem)
    n_own = -(-(chi - clo) // seg)      # this worker's segments (empty chunks are not sent)
    per = -(-big // seg)                # the most segments of a chunk: reduce-scatter step s's keys are s * per + j
    # every all-gather region, in the order its receives are posted (step s: chunk (r - s)'s segments)
    c = (r + 1) % n
    n_ag = rem * -(-(q + 1) // seg) + (n - rem) * -(-q // seg) - -(-(q + (1 if c < rem else 0)) // seg)
    sent = 0                # this worker's sends so far: send i is held under i (an all-gather receive frees it)
    # reduce-scatter: step s adds chunk (r-s-1) from the left; each reduced segment goes on to the right
    # at once (it is the next step's outgoing data; after the last step, all-gather step 0's). The receives
    # of a step are posted nbufs - 1 steps ahead (rs_buffers), into the workspace's buffers in turn, each
    # once the step that used it before has been summed; segment j of step s is key s * per + j.
    # All-gather step s receives chunk (r - s) into ``acc``, the chunk reduce-scatter step s sent: in
    # order, region i (key -1 - i) once the reduce-scatter send i is done with it (``Flush(i)``). gloo sends
    # only to a posted receive, so these are posted during the reduce-scatter, not after it (a receive posted
    # late idles the left neighbour's link): from reduce-scatter step n - 3 on (once every reduce-scatter
    # receive is posted, so that messages on the tag match receives in order), after the m-th
    # reduce-scatter segment has arrived, up to region m, whose send left about when that segment did. One
    # generator, no nested ones: each request passes one frame on its way to the scheduler.
    ag_posted = 0           # all-gather receives posted: region i under the key -1 - i
    # all-gather region i is the region of this worker's send i (own chunk r, then the reduce-scatter's
    # chunks r - 1, r - 2, ...: chunk r - s is all-gather step s's): its receive is posted into that view
    regions: deque = deque()    # the views of the sends whose regions' all-gather receives are not posted yet
    last = n - 2            # the last reduce-scatter step
    rs_done = n == 2        # the all-gather's receives may be posted
    ahead = max(1, nbufs - 1)   # reduce-scatter steps whose receives are posted before this rank's data goes out
    for s in range(-ahead, n - 1):
        t = s + ahead           # the receives of step t (chunk r - t - 1's segments), into buffer t mod nbufs
        if t <= last:
            c = (r - t - 1) % n
            longer = 1 if c < rem else 0
            k, key = t % nbufs, t * per
            segs = views[k][longer]
            if segs is None:
                length, b = q + longer, bufs[k]
                segs = views[k][longer] = [b[a:a + seg if a + seg < length else length] for a in range(0, length, seg)]
            for v in segs:
                yield _new(PostInto, (key, v, left, tag))
                key += 1
        if s < 0:
            if s + 1 == 0:      # (the last of them) this rank's own chunk goes out
                for lo in range(clo, chi, seg):
                    region = chunks[r] if chunks is not None else acc[lo:lo + seg if lo + seg < chi else chi]
                    regions.append(region)
                    yield _new(Send, (region, right, tag, sent, False, False))
                    sent += 1
            continue
        if s + 1 == last:
            rs_done = True
        c = (r - s - 1) % n
        lo0 = c * q + (c if c < rem else rem)       # (_chunk, inline: once per step)
        hi0 = lo0 + q + (1 if c < rem else 0)
        key = s * per
        for lo in range(lo0, hi0, seg):
            yield _new(Recv, ((key,), _STEP, (), False, None))
            if chunks is not None:
                region = chunks[c]
                hi = hi0
            else:
                hi = lo + seg if lo + seg < hi0 else hi0
                region = acc[lo:hi]
            regions.append(region)
            region.add_(inbox.take(key))
            key += 1
            if host_work is not None:
                host_work("sum", hi - lo, dtype)
            yield _new(Send, (region, right, tag, sent, False, False))
            sent += 1
            if rs_done:
                upto = sent - n_own if sent - n_own < n_ag else n_ag
                while ag_posted < upto:
                    yield _new(Flush, (ag_posted,))
                    ag_posted += 1
                    yield _new(PostInto, (-ag_posted, regions.popleft(), left, tag))
    while ag_posted < n_ag:
        yield _new(Flush, (ag_posted,))
        ag_posted += 1
        yield _new(PostInto, (-ag_posted, regions.popleft(), left, tag))
    key = -1
    for s in range(n - 1):
        c = (r - s) % n
        lo0 = c * q + (c if c < rem else rem)       # (_chunk, inline)
        hi0 = lo0 + q + (1 if c < rem else 0)
        for _ in range(lo0, hi0, seg):
            yield _new(Recv, ((key,), _STEP, (), False, None))
            region = inbox.take(key)        # (the view of ``acc`` it was posted into)
            key -= 1
            if s < last:
                yield _new(Send, (region, right, tag, None, False, False))
    if out is not None:
        out.append((acc, note))
    return acc


@registry.register("ring")
class Ring(Transport):
    """Reduce-scatter + all-gather ring over the fabric (see the module docstring)."""

    name = "ring"
    folds = True        # a predicted float call skips its handshake (:mod:`._fold`); it keeps the call record
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"dense", "aligned", "quantized"})

    def __init__(self, fabric: Fabric, *, tag: int = RING_TAG, segment_bytes: int | None = None,
                 inplace: bool = False, nonfinite: str = "raise") -> None:
        super().__init__(fabric)
        self.nonfinite = nonfinite_option(nonfinite, "ring")
        if not fabric.is_worker:
            raise InvalidValueError("transports run on workers, not on service endpoints")
        if segment_bytes is not None and segment_bytes <= 0:
            raise InvalidValueError(f"segment_bytes must be positive (or None: the default rule of "
                                    f"segment_length), got {segment_bytes}")
        self.tag = tag
        self.segment_bytes = None if segment_bytes is None else int(segment_bytes)
        self.inplace = inplace   # sum a plain tensor input into itself (scratch buckets) instead of a copy
        self._workspace: dict = {}

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.ring_allreduce` of the call's wire bytes, in its elements."""
        return costs.ring_allreduce(self.fabric.world_size, call.wire_bytes, elem_size=call.elem_size,
                                    bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        op = linear_operand(flat, self.name, inplace=self.inplace)
        return op.finish(self._sum_linear(op))

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        size = op.vector.element_size()
        segment = segment_length(-(-op.vector.numel() // max(1, self.fabric.world_size)),
                                 None if self.segment_bytes is None else max(1, self.segment_bytes // size), size)
        f, what, extra = self.fabric, "ring allreduce", dict(segment_length=segment)
        n = f.world_size
        if n == 1:
            return guarded_sum(f, what, op, extra, self.nonfinite, lambda a: a)

        sched, key, fold, fast = self._enter(op, segment)
        # the handshake and the ring's steps in one drive: the agreement's rounds first, each done (its
        # send completed) before the next, then the ring's, as two drives would send them; a predicted
        # call (fast) has no handshake (a deviator joins it with NaN instead: :meth:`_enter`)
        pool = Pool()
        inbox, outbox = Inbox(f, pool), Outbox(f, pool)
        out: list = []      # (sum, widened): the ring's steps run in the role's own frame, the handshake first
        if fast:
            role = ring_role(f, op.work_copy(f), inbox, self.tag, segment, self._workspace, out=out)
        else:
            role = ring_role(f, None, inbox, self.tag, segment, self._workspace, out=out,
                             prologue=guarded_vector_role(f, inbox, what, op, extra))
        f.drive([role], inbox, outbox)
        outbox.finish()
        f.stats.rounds += 2 * (n - 1)
        if fast:
            sched.folded += 1
            if bool(torch.isnan(out[0][0][:1]).any()):   # a deviator's NaN fills every element: the handshake
                check_agreement(f, what, **op.fields, **extra)
        if sched is not None:
            sched.record(key, fold)
        return guarded_finish(f, what, op, *out[0], self.nonfinite)

    def _enter(self, op: LinearOperand, segment: int):
        """The call's place in the fabric's record of calls (:mod:`._fold`): ``(schedule, key, fold, fast)``.
        ``fold``: how a deviator joins this call (a float vector of at most :data:`._fold.FOLD_MAX_BYTES`;
        else None); ``fast``: this call is the predicted one (it skips its handshake). A call that is not
        the predicted one joins the predicted call first (NaN); its own handshake then meets those of the
        workers that took the fast path. No record (the SimFabric): ``(None, None, None, False)``."""
        sched = _fold.schedule(self.fabric)
        if sched is None:
            return None, None, None, False
        v = op.vector
        key = ("ring", *[(k, int(val)) for k, val in op.fields.items()], ("segment_length", segment),
               *sched.call_key())
        fold = None
        if v.is_floating_point() and not op.codes and 0 < v.numel() * v.element_size() <= _fold.FOLD_MAX_BYTES:
            fold = _fold.Fold(key, v.numel(), v.dtype, v.device, functools.partial(self._join, segment))
        predicted = sched.predicted()
        fast = predicted is not None and fold is not None and predicted.key == key
        if predicted is not None and not fast:
            sched.deviate(predicted)        # then this call's own handshake (guarded_vector_role, the ring role's prologue)
        return sched, key, fold, fast

    def _join(self, segment: int, vector: torch.Tensor) -> None:
        """A deviator's part in the predicted call (:meth:`_fold.Schedule.deviate`): the ring's steps on
        ``vector`` (NaN), without a handshake, the sum dropped."""
        pool = Pool()
        inbox, outbox = Inbox(self.fabric, pool), Outbox(self.fabric, pool)
        self.fabric.drive([ring_role(self.fabric, vector, inbox, self.tag, segment, self._workspace)], inbox, outbox)
        outbox.finish()

