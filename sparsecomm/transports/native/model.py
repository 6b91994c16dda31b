"""``native``'s model: gloo's ring all-reduce written against the Fabric, for a fabric that models time.

``native`` is ``torch.distributed.all_reduce``, which exists only on a TorchFabric. A model of a run on real
processes (the SimFabric with a calibrated host: ``experiments/bench/netbed_vs_sim.py``'s modelled side,
``sparsecomm.netbed.calibrate``'s per-call and sync timings, ``experiments/reproduce_training.py``'s modelled
column for stock DDP and for the hook's default ``native`` calls) stands :class:`GlooRing` in for it: the messages
gloo's own algorithm sends, each charged the host's cost of a message of gloo's C++ rather than of this library's
Python (:meth:`sparsecomm.fabric.base.Fabric.native_messages`).

What torch 2.13 runs for a CPU tensor (``dist.all_reduce`` over gloo): ``ProcessGroupGloo``'s
``AsyncAllreduceWork`` (pytorch ``torch/csrc/distributed/c10d/ProcessGroupGlooDetail.hpp``) sets the tensor as the
one output of ``gloo::AllreduceOptions`` (in place: no input buffer, so its local reduction and broadcast are
no-ops), a sum function and a tag, and calls ``gloo::allreduce`` with the algorithm unspecified, which runs
``ring`` (pytorch/gloo ``gloo/allreduce.cc``; its shared-memory path for ranks of one node, added in January 2026,
was reverted in February and is not in torch 2.13's ``libtorch_cpu``). That ring:

- splits the ``B`` bytes into ``N = roundUp(max(ceil(B / M), 2 n), n)`` segments of ``roundUp(ceil(B / N),
  element size)`` bytes (``M``: ``maxSegmentSize``, 1 MiB by default, ``gloo/allreduce.h``), ``S = N / n`` per rank,
  the last ones shorter or empty (an empty one is not sent);
- reduce-scatter, iterations ``i = 0 .. N - S + 1``: from ``i >= 2`` it waits for the receive of iteration
  ``i - 2`` (into the two-segment scratch buffer, slot ``i & 1``), sums it into the tensor at its offset, and waits
  for that iteration's send; below ``N - S`` it posts the receive of segment ``((r + 2) S + i) mod N`` from rank
  ``r + 1`` and sends segment ``((r + 1) S + i) mod N`` to rank ``r - 1`` (for ``i >= S`` the segment received
  ``S`` iterations before, summed since): two sends and two receives in flight at most;
- all-gather, the same iterations: it posts the receive of segment ``((r + 1) S + i) mod N`` straight into the
  tensor and sends segment ``(r S + i) mod N`` (for ``i >= S`` the one received ``S`` iterations before), waiting
  for iteration ``i - 2``'s receive and send from ``i >= 2``.

Every rank sends ``2 (N - S)`` messages (fewer where trailing segments are empty), ``2 (n - 1) / n`` of the
tensor in all, as the library's ``ring``, but in segments of at most 1 MiB, two in flight, where the library's ring
sends each chunk in one or two segments of up to 4 MiB (:func:`~sparsecomm.transports.ring.segment_length`).
The sends, receives and waits run in C++ on gloo's threads: on a host model each message is charged the model's
native message rates (:meth:`~sparsecomm.fabric.sim.sim_host.HostModel.native_messages`, fitted by ``python -m
sparsecomm.netbed calibrate`` on ``dist.all_reduce``'s own calls), each segment summed at the model's rate of its
dtype (``"sum"``), and the call charged ``native``'s per-call cost (``call_s["native"]``, this transport's
:attr:`~GlooRing.name`: the rest of a ``native`` call, its Python).

The passes of ``native``'s default call beyond gloo's all-reduce are modelled as ``native`` makes them in its
steady state (a repeated float call folds its agreement into the data: no handshake, :mod:`.._fold`): the copy
of the input into a fresh work buffer unless ``inplace`` (``"copy"``, ``"fresh"``) and, with ``nonfinite="raise"``,
the finiteness check of the sum (``"check"``). An integer or quantized operand runs the agreement handshake first
(``native``'s path for a call that does not fold) and is summed in a dtype of at least int32, as ``native`` sums it.
"""

from __future__ import annotations

import torch

from ...errors import InvalidValueError
from ...fabric.base import Fabric
from ...fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step
from .._guards import nonfinite_option
from ..base import Transport
from ..linear import LinearOperand, guarded_finish, guarded_sum, linear_operand
from . import Native

__all__ = ["GLOO_MAX_SEGMENT_BYTES", "GlooRing", "gloo_ring_plan", "gloo_ring_role"]

#: gloo's ``AllreduceOptionsImpl::kMaxSegmentSize`` (``gloo/allreduce.h``): the longest segment of its ring
GLOO_MAX_SEGMENT_BYTES = 1 << 20
#: the tag of the model's messages
GLOO_RING_TAG = 0x6100
#: the stage of the ring's waits (one role)
_STEP = Step()


def gloo_ring_plan(numel: int, elem_size: int, n: int,
                   max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> tuple[int, int]:
    """``(segments, segment elements)`` of gloo's ring for ``numel`` elements of ``elem_size`` bytes on ``n``
    ranks (module docstring; ``gloo/allreduce.cc``, ``ring``): ``N = roundUp(max(ceil(B / M), 2 n), n)`` segments
    of ``roundUp(ceil(B / N), elem_size)`` bytes, ``M`` the largest multiple of the element size not above
    ``max_segment_bytes`` (at least one element)."""
    total = numel * elem_size
    seg_max = elem_size * max(1, max_segment_bytes // elem_size)
    segments = max(-(-total // seg_max), 2 * n)
    segments = -(-segments // n) * n
    seg_bytes = -(-(-(-total // segments)) // elem_size) * elem_size
    return segments, seg_bytes // elem_size


def gloo_ring_role(fabric: Fabric, acc: torch.Tensor, inbox: Inbox, tag: int = GLOO_RING_TAG,
                   max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES, scratch: torch.Tensor | None = None):
    """gloo's ring all-reduce of the flat ``acc`` in place on this worker, as one role
    (:mod:`sparsecomm.fabric.roles`; the module docstring's steps, in ``gloo/allreduce.cc``'s order): its sends
    (each held under its iteration, which a :class:`~sparsecomm.fabric.roles.Flush` waits for two iterations
    later, as gloo's ``waitSend``), its receives posted into the two segments of ``scratch`` (reduce-scatter, a
    buffer of at least two segments, made if ``None``) or into ``acc`` (all-gather), and the sums of the
    reduce-scatter, each declared to the fabric's host model (``"sum"``). Returns ``acc``."""
    n, r = fabric.world_size, fabric.rank
    numel = acc.numel()
    segments, seg = gloo_ring_plan(numel, acc.element_size(), n, max_segment_bytes)
    per = segments // n
    span = segments * seg
    send_to, recv_from = (r - 1) % n, (r + 1) % n       # (gloo's ring sends to the left)
    if scratch is None or scratch.numel() < 2 * seg:
        scratch = torch.empty(2 * seg, dtype=acc.dtype, device=acc.device)
    slots = (scratch[:seg], scratch[seg:2 * seg])
    host_work, dtype = fabric.host_work, acc.dtype
    iterations = segments - per

    def bounds(first: int, i: int) -> tuple[int, int]:
        lo = ((first * per + i) * seg) % span
        return lo, min(lo + seg, numel)

    for phase in (0, 1):
        sent = {}
        for i in range(iterations + 2):
            if i >= 2:
                lo, hi = bounds(r + 2 - phase, i - 2)        # (the receive of iteration i - 2)
                if hi > lo:
                    key = (phase, i - 2)
                    yield Recv.new(((key,), _STEP, (), False, None))
                    got = inbox.take(key)
                    if phase == 0:
                        acc[lo:hi].add_(got[:hi - lo])
                        host_work("sum", hi - lo, dtype)
                if sent.pop(i - 2, False):
                    yield Flush.new(((phase, i - 2),))
            if i < iterations:
                lo, hi = bounds(r + 2 - phase, i)
                if hi > lo:
                    into = slots[i & 1][:hi - lo] if phase == 0 else acc[lo:hi]
                    yield PostInto.new(((phase, i), into, recv_from, tag))
                lo, hi = bounds(r + 1 - phase, i)
                if hi > lo:
                    yield Send.new((acc[lo:hi], send_to, tag, (phase, i), False, False))
                    sent[i] = True
    return acc


class GlooRing(Transport):
    """gloo's ring all-reduce over the fabric, ``native``'s stand-in in a model (module docstring). Its
    :attr:`name` is ``native``'s: its calls are charged, traced and priced as ``native``'s.

    Args:
        fabric: the fabric the collective runs over (a SimFabric, for a model; any fabric runs it).
        inplace: sum a plain tensor input into itself, as ``native(inplace=True)``, instead of a fresh copy.
        nonfinite: ``native``'s rule for a NaN/Inf in the sum (``"raise"``: checked, as ``native`` checks it).
        max_segment_bytes: the longest segment (gloo's ``maxSegmentSize``, 1 MiB).
    """

    name = "native"
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"dense", "aligned", "quantized"})

    def __init__(self, fabric: Fabric, *, inplace: bool = False, nonfinite: str = "raise",
                 max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> None:
        super().__init__(fabric)
        if not fabric.is_worker:
            raise InvalidValueError("transports run on workers, not on service endpoints")
        if max_segment_bytes <= 0:
            raise InvalidValueError(f"max_segment_bytes must be positive, got {max_segment_bytes}")
        self.inplace = inplace
        self.nonfinite = nonfinite_option(nonfinite, "native")
        self.max_segment_bytes = int(max_segment_bytes)
        self._scratch: dict = {}        # (dtype, device) -> gloo's two-segment scratch buffer (its own, per call)

    #: ``native``'s closed form (:func:`~sparsecomm.theory.costs.native_allreduce` of the call's wire bytes)
    cost = Native.cost

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        op = linear_operand(flat, self.name, inplace=self.inplace)
        return op.finish(self._sum_linear(op))

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        f, what = self.fabric, "native allreduce"
        v = op.vector
        if v.is_floating_point() and not op.codes:      # (native's steady state: folded, no handshake)
            return guarded_finish(f, what, op, self._reduce(op.work_copy(f)), False, self.nonfinite)
        return guarded_sum(f, what, op, {}, self.nonfinite, self._reduce, int_floor=torch.int32)

    def _reduce(self, acc: torch.Tensor) -> torch.Tensor:
        """gloo's ring on ``acc`` in place (:func:`gloo_ring_role`), its messages the fabric's native ones."""
        f = self.fabric
        if f.world_size == 1 or acc.numel() == 0:
            return acc
        _, seg = gloo_ring_plan(acc.numel(), acc.element_size(), f.world_size, self.max_segment_bytes)
        key = (acc.dtype, acc.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < 2 * seg:
            scratch = self._scratch[key] = torch.empty(2 * seg, dtype=acc.dtype, device=acc.device)
        pool = Pool()
        inbox, outbox = Inbox(f, pool), Outbox(f, pool)
        with f.native_messages():
            f.drive([gloo_ring_role(f, acc, inbox, GLOO_RING_TAG, self.max_segment_bytes, scratch)], inbox, outbox)
            outbox.finish()
        f.stats.rounds += 2 * (f.world_size - 1)
        return acc
