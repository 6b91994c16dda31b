"""Replica consistency: rank 0's initial parameters and buffers on every worker (as DDP broadcasts them),
or a check that every worker already holds them; and the guard that checks, during training, that the
replicas are still identical (:func:`verify_replicas`).

``sync_replicas(fabric, tensors, mode="broadcast"|"check")`` over any :class:`~sparsecomm.fabric.Fabric`
(point-to-point messages through rank 0, so it runs on SimFabric and TorchFabric alike):

1. rank 0 sends a fixed-size header (tensor count, total bytes, a digest of the shapes and dtypes) to
   every worker; each compares it with its own and answers with a verdict (and, for ``check``, a
   digest of its tensors' bytes); rank 0 decides and sends the decision to every worker;
2. on a mismatch every worker raises the same :class:`~sparsecomm.errors.MismatchError`; otherwise,
   for ``broadcast``, rank 0 sends its tensors' bytes (one message per dtype) and every worker copies
   them in.

``verify_replicas(fabric, named)`` (the ``verify_replicas_every=N`` option of
:class:`~sparsecomm.DistributedOptimizer` and of the DDP hook) compares the workers' tensors by their
checksums (:func:`sparsecomm.codec.checksum.checksum`, one pass over the memory): the workers gather a
fixed-size header from every worker (tensor count, a digest of the names, shapes and dtypes, and a
digest of the per-tensor checksums: :func:`gather_words`, one ``all_gather`` on a torch.distributed
fabric); only if the digests differ do they gather the per-tensor checksums, to name the first tensor
that differs. Every worker decides from the same table, so every worker raises the same
:class:`~sparsecomm.errors.MismatchError`.

Both exchanges are roles (:func:`sync_role`, :func:`gather_role`: they yield their sends and receives) that
the fabric runs (``Fabric.drive``), each send waited for before the next step as a blocking send.

Nothing a peer sends is unpickled or sized by the peer: every receive buffer has the size this rank
computed from its own tensors, after the header agreed.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch

from .errors import InvalidValueError, MismatchError
from .fabric.engine import drain
from .fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step

#: the tag of these messages (top of the int32 range, below the barrier's)
TAG = 2**31 - 6
#: the tag of :func:`verify_replicas`'s messages
VERIFY_TAG = 2**31 - 7

_OK, _SHAPES, _VALUES = 0, 1, 2

#: the default of ``verify_replicas_every``: the replicas are compared every this many steps
VERIFY_EVERY = 100


def check_verify_every(every) -> int:
    """``verify_replicas_every`` checked: a non-negative int (0: never)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise InvalidValueError(f"verify_replicas_every must be a non-negative int (0: never), got {every!r}")
    return every


def _digest(data: bytes) -> int:
    return struct.unpack("<q", hashlib.blake2b(data, digest_size=8).digest())[0]


def _layout_digest(tensors: Sequence[torch.Tensor]) -> int:
    return _digest(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode())


def _value_digest(tensors: Sequence[torch.Tensor]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return struct.unpack("<q", h.digest())[0]


def _groups(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


#: the stage of each wait of these exchanges (one role each: no preference to state)
_STEP = Step()
#: the role of the pooled send buffer of every send (each is waited for before the next, as a blocking send)
_SENT = "replicas"


def _drive(fabric, make) -> None:
    """Run the role ``make(inbox)`` alone on ``fabric`` (``Fabric.drive``), with an inbox and outbox of its own."""
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    fabric.drive([make(inbox)], inbox, outbox)
    outbox.finish()


def _send(buf: torch.Tensor, dst: int, tag: int):
    """Send ``buf`` to ``dst`` and wait until the send has completed (a blocking send, as requests)."""
    yield Send(buf, dst, tag, hold=_SENT)
    yield Flush(_SENT)


def _receive(inbox: Inbox, buf: torch.Tensor, src: int, tag: int, key):
    """Receive ``buf`` from ``src`` (a blocking receive, as requests); the received tensor."""
    yield PostInto(key, buf, src, tag)
    yield Recv((key,), _STEP)
    return inbox.take(key)


@torch.no_grad()
def sync_replicas(fabric, tensors: Sequence[torch.Tensor], mode: str = "broadcast") -> None:
    """Make (``broadcast``) or verify (``check``) ``tensors`` identical on every worker (see module doc); the
    exchange is one role (:func:`sync_role`) that ``fabric.drive`` runs."""
    if mode not in ("broadcast", "check"):
        raise InvalidValueError(f"mode must be 'broadcast' or 'check', got {mode!r}")
    if int(fabric.world_size) == 1:
        return
    drain(fabric)                       # nothing of ours may be in flight on the fabric
    _drive(fabric, lambda inbox: sync_role(fabric, inbox, tensors, mode))


def sync_role(fabric, inbox: Inbox, tensors: Sequence[torch.Tensor], mode: str):
    """:func:`sync_replicas`'s exchange on this worker as a role (:mod:`sparsecomm.fabric.roles`): in the order
    of the module doc, each send followed by a wait for its completion and each receive posted, waited for
    and taken from ``inbox``; it raises what :func:`sync_replicas` raises. ``fabric`` is read for its rank,
    world size and device. For two workers or more."""
    n, rank = int(fabric.world_size), int(fabric.rank)
    dev = fabric.device
    # dedupe (a tensor listed twice, shared parameters)
    seen: set[int] = set()
    ts = [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    header = torch.tensor([len(ts), nbytes, _layout_digest(ts)], dtype=torch.int64)
    values = _value_digest(ts) if mode == "check" else 0
    if rank == 0:
        for r in range(1, n):
            yield from _send(header.to(dev), r, TAG)
        worst, bad_rank = _OK, -1
        for r in range(1, n):
            reply = yield from _receive(inbox, torch.zeros(2, dtype=torch.int64, device=dev), r, TAG, ("reply", r))
            verdict = int(reply[0])
            if verdict == _OK and mode == "check" and int(reply[1]) != values:
                verdict = _VALUES
            if verdict != _OK and worst == _OK:
                worst, bad_rank = verdict, r
        decision = torch.tensor([worst, bad_rank], dtype=torch.int64)
        for r in range(1, n):
            yield from _send(decision.to(dev), r, TAG)
    else:
        theirs = yield from _receive(inbox, torch.zeros(3, dtype=torch.int64, device=dev), 0, TAG, "header")
        ok = torch.equal(theirs.cpu(), header)
        reply = torch.tensor([_OK if ok else _SHAPES, values], dtype=torch.int64)
        yield from _send(reply.to(dev), 0, TAG)
        decision = yield from _receive(inbox, torch.zeros(2, dtype=torch.int64, device=dev), 0, TAG, "decision")
        decision = decision.cpu()
    worst, bad_rank = int(decision[0]), int(decision[1])
    if worst == _SHAPES:
        raise MismatchError(
            f"the workers' models differ in their parameters' shapes or dtypes (worker {bad_rank} "
            f"disagrees with worker 0): every worker must build the same model")
    if worst == _VALUES:
        raise MismatchError(
            f"the workers start from different parameters (worker {bad_rank} differs from worker 0) and "
            f"init_sync='check' was asked; use init_sync='broadcast' (the default) to copy worker 0's, or "
            f"build the model identically on every worker (on the sim backend: `with ctx.seeded(0): "
            f"model = make_model()`)")
    if mode == "check":
        return
    for dtype, group in _groups(ts).items():
        flat_len = sum(t.numel() for t in group)
        if rank == 0:
            flat = torch.cat([t.detach().reshape(-1) for t in group]).to(dev)
            for r in range(1, n):
                yield from _send(flat, r, TAG)
        else:
            flat = yield from _receive(inbox, torch.empty(flat_len, dtype=dtype, device=dev), 0, TAG,
                                       ("values", dtype))
            with torch.no_grad():       # (the parameters are leaves: no_grad on the thread that runs the role)
                off = 0
                for t in group:
                    k = t.numel()
                    t.copy_(flat[off:off + k].view_as(t))
                    off += k


def gather_words(fabric, words: torch.Tensor) -> torch.Tensor:
    """Every worker's int64 ``words`` (the same length on every worker), as an ``(n, len)`` table in rank
    order on every worker: one ``all_gather`` where the fabric has a native process group, else through
    rank 0 (its receives sized by its own ``words``; one role, :func:`gather_role`, that ``fabric.drive``
    runs)."""
    n = int(fabric.world_size)
    dev = fabric.device
    words = words.to(dev)
    group = fabric.native_group
    if group is not None:
        import torch.distributed as dist

        from .fabric.torch.torch_waiters import retain

        out = torch.empty(n * words.numel(), dtype=torch.int64, device=dev)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, words, group=group)
        retain(out, words)
        return out.view(n, -1).cpu()
    table = torch.empty(n, words.numel(), dtype=torch.int64, device=dev)
    _drive(fabric, lambda inbox: gather_role(fabric, inbox, words, table))
    return table.cpu()


def gather_role(fabric, inbox: Inbox, words: torch.Tensor, table: torch.Tensor):
    """:func:`gather_words` through rank 0 on this worker as a role (:mod:`sparsecomm.fabric.roles`): it fills
    ``table`` (``(n, len)``, on the fabric's device) with every worker's ``words``, in rank order."""
    n, rank = int(fabric.world_size), int(fabric.rank)
    if rank == 0:
        table[0] = words
        for r in range(1, n):
            yield from _receive(inbox, table[r], r, VERIFY_TAG, ("words", r))
        for r in range(1, n):
            yield from _send(table, r, VERIFY_TAG)
    else:
        yield from _send(words, 0, VERIFY_TAG)
        yield from _receive(inbox, table, 0, VERIFY_TAG, "table")


@torch.no_grad()
def verify_replicas(fabric, named: Sequence[tuple[str, torch.Tensor]], *, when: str = "") -> None:
    """Raise :class:`~sparsecomm.errors.MismatchError` on every worker unless every worker holds the
    same ``(name, tensor)`` list, bit for bit; the error names the first tensor (in this order) that
    differs and two workers that disagree on it. Every worker must call it at the same point of its
    training (``when`` says which, in the message: ``"after step 200"``). Cost: one checksum pass over
    the tensors and, when they agree, one gather of three words per worker (:func:`gather_words`);
    every worker decides alike from the same table."""
    from .codec.checksum import checksum

    n = int(fabric.world_size)
    if n == 1:
        return
    drain(fabric)                       # nothing of ours may be in flight on the fabric
    sums = torch.tensor([checksum(t) for _, t in named], dtype=torch.int64)
    layout = _digest(repr([(nm, tuple(t.shape), str(t.dtype)) for nm, t in named]).encode())
    heads = gather_words(fabric, torch.tensor([len(named), layout, _digest(sums.numpy().tobytes())],
                                              dtype=torch.int64))
    at = f" {when}" if when else ""
    bad = next((r for r in range(1, n) if not torch.equal(heads[r, :2], heads[0, :2])), None)
    if bad is not None:
        raise MismatchError(f"replica check{at}: the workers' parameters differ in their names, shapes or "
                            f"dtypes (worker {bad} disagrees with worker 0): every worker must train the "
                            f"same model")
    if bool((heads[:, 2] == heads[0, 2]).all()):
        return
    table = gather_words(fabric, sums)        # the same length everywhere: the layouts agree
    col = int((table != table[0]).any(0).nonzero()[0])
    who = int((table[:, col] != table[0, col]).nonzero()[0])
    name, t = named[col]
    raise MismatchError(
        f"replica check{at}: the replicas have drifted apart: parameter {name!r} (shape "
        f"{list(t.shape)}) differs between worker 0 and worker {who}; the first of the "
        f"{len(named)} checked that differs. Every worker must apply the same update: look for a "
        f"worker-specific step (a learning rate, a skipped step, gradient clipping before "
        f"synchronising) or report it with the method and transport used")
