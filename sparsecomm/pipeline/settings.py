"""The user-facing configuration every worker must share, agreed once when a
:class:`~sparsecomm.DistributedOptimizer` or a DDP hook state (:class:`~sparsecomm.ddp.CommHookState`)
is built: the method, the compressor and their hyper-parameters, the transport and its options,
``warmup_steps``, ``seed`` and the frontend's own options. Workers built with different settings get
one :class:`~sparsecomm.errors.MismatchError`, on every worker, naming the first setting that differs
with both values and both workers, before any gradient moves (instead of a disagreement in wire terms,
a payload kind or a length, at the first step).

:func:`describe` lists the settings of a pipeline, in the order a difference is reported (the method
before its compressor before their hyper-parameters, then the transport), as ``(name, value)`` lines of
text; :func:`agree` compares them, point to point through rank 0 over any
:class:`~sparsecomm.fabric.base.Fabric` (SimFabric and TorchFabric alike), a digest first and the detail
only on a difference:

1. every worker sends rank 0 a fixed-size header ``int64[2]``: a magic word and a 63-bit digest
   (blake2b) of its settings' text;
2. rank 0 sends every worker the decision ``int64[3]``: the magic word, 0 (all agree) or 1, and the
   lowest worker ``r`` whose digest differs from rank 0's;
3. on a difference, worker ``r`` sends rank 0 its text in a buffer of :data:`TEXT_BYTES` bytes (UTF-8,
   zero-padded; a longer text is cut at a line, and the digest still covers all of it); rank 0 sends
   every worker its own text and ``r``'s in two such buffers;
4. every worker raises the same error, computed from the two texts.

The exchange is one role (:func:`agree_role`: it yields its sends and receives) that the fabric runs
(``Fabric.drive``), in the order above, each send waited for before the next step as a blocking send.
Every message has a size fixed by this module; nothing received is unpickled (the texts are decoded
as UTF-8 with invalid bytes replaced, and only shown); a decision naming a worker outside
``1 .. n-1`` or a wrong magic word is :class:`~sparsecomm.errors.MalformedMessage`. Cost: two messages
per worker when the settings agree (one header to rank 0, one decision back).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch

from .. import methods
from ..errors import MalformedMessage, MismatchError
from ..fabric.engine import drain
from ..fabric.roles import Flush, Inbox, Outbox, Pool, PostInto, Recv, Send, Step
from ..methods import Method, Warmup
from ..transports.base import Transport

#: the tag of these messages (below :mod:`sparsecomm.replicas`'s and the fabric's reserved tags)
TAG = 2**31 - 9
#: the first word of every header and decision ("SCCF", version 1)
MAGIC = 0x53434346_0001
#: bytes of a settings text on the wire (a longer text is cut at a line)
TEXT_BYTES = 4096

Setting = tuple[str, str]


def describe(method: Method, transport: Transport, transport_kwargs: dict | None = None) -> list[Setting]:
    """The settings of a pipeline running ``method`` over ``transport``: the method (unwrapped from
    :class:`~sparsecomm.methods.Warmup`: ``warmup_steps`` is the frontend's setting), its compressor
    (when the method wraps one), their hyper-parameters, the transport's name and the options given for
    it, each as ``(name, value text)``."""
    while isinstance(method, Warmup):
        method = method.inner
    out: list[Setting] = [("method", repr(method.name))]
    comp = method.compressor if methods.wraps_compressor(method.name) else None
    cname = None
    if comp is not None:
        cname = comp.name or type(comp).__name__
        out.append(("compressor", repr(cname)))
    out += [(f"{k} of method {method.name!r}", repr(v)) for k, v in method.hyper().items() if k != "compressor"]
    if comp is not None:
        out += [(f"{k} of compressor {cname!r}", repr(v)) for k, v in comp.hyper().items()]
    tname = transport.name or type(transport).__name__
    out.append(("transport", repr(tname)))
    out += [(f"{k} of transport {tname!r}", repr(v)) for k, v in sorted((transport_kwargs or {}).items())]
    return out


def _text(settings: Sequence[Setting]) -> bytes:
    return "\n".join(f"{n}\t{v}" for n, v in settings).encode()


def _digest(data: bytes) -> int:
    return struct.unpack("<q", hashlib.blake2b(data, digest_size=8).digest())[0] & ((1 << 63) - 1)


def _pack(data: bytes) -> torch.Tensor:
    if len(data) > TEXT_BYTES:
        cut = data.rfind(b"\n", 0, TEXT_BYTES)
        data = data[:cut if cut > 0 else TEXT_BYTES]
    buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _lines(buf: torch.Tensor) -> list[Setting]:
    raw = bytes(buf.cpu().numpy().tobytes()).rstrip(b"\x00").decode("utf-8", errors="replace")
    return [tuple(line.split("\t", 1)) if "\t" in line else (line, "") for line in raw.split("\n") if line]


def _error(what: str, mine: list[Setting], theirs: list[Setting], r: int, rank: int) -> MismatchError:
    """The error naming the first setting that differs between rank 0 (``mine``) and worker ``r``."""
    i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    a = mine[i] if i < len(mine) else None
    b = theirs[i] if i < len(theirs) else None
    if a is not None and b is not None and a[0] == b[0]:
        detail = f"{a[0]} is {a[1]} on worker 0 and {b[1]} on worker {r}"
    elif a is None and b is None:
        detail = f"their settings differ beyond the first {TEXT_BYTES} bytes of their description"
    else:
        def show(s: Setting | None, w: int) -> str:
            return f"worker {w} has {s[0]} = {s[1]}" if s is not None else f"worker {w} has no further setting"

        detail = f"{show(a, 0)} where {show(b, r)}"
    return MismatchError(f"{what}: the workers were built with different settings: {detail} (this is worker "
                         f"{rank}); every worker must pass the same method, compressor, transport and options")


@torch.no_grad()
def agree(fabric, what: str, settings: Sequence[Setting]) -> None:
    """Raise :class:`~sparsecomm.errors.MismatchError` on every worker unless every worker passes the same
    ``settings`` (see the module doc); ``what`` names the object being built in the message. Every
    worker must call it at the same point (the frontends call it in their constructors). The exchange is
    one role (:func:`agree_role`) that ``fabric.drive`` runs."""
    if int(fabric.world_size) == 1:
        return
    drain(fabric)                       # nothing of ours may be in flight on the fabric
    pool = Pool()
    inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
    fabric.drive([agree_role(fabric, inbox, what, settings)], inbox, outbox)
    outbox.finish()


#: the stage of each of the exchange's waits (one role: no preference to state)
_STEP = Step()
#: the role of the pooled send buffer of every send (each is waited for before the next, as a blocking send)
_SENT = "settings"


def _send(buf: torch.Tensor, dst: int):
    """Send ``buf`` to ``dst`` and wait until the send has completed (a blocking send, as requests)."""
    yield Send(buf, dst, TAG, hold=_SENT)
    yield Flush(_SENT)


def _receive(inbox: Inbox, buf: torch.Tensor, src: int, key):
    """Receive ``buf`` from ``src`` (a blocking receive, as requests); the received tensor."""
    yield PostInto(key, buf, src, TAG)
    yield Recv((key,), _STEP)
    return inbox.take(key)


def agree_role(fabric, inbox: Inbox, what: str, settings: Sequence[Setting]):
    """:func:`agree`'s exchange on this worker as a role (:mod:`sparsecomm.fabric.roles`): it yields its
    sends, each followed by a wait for its completion (:class:`~sparsecomm.fabric.roles.Flush`), and per
    receive the receive it posts and a wait for it, then takes the message from ``inbox``, in the order of
    the module doc; it raises what :func:`agree` raises. ``fabric`` is read for its rank, world size and
    device. For two workers or more."""
    n, rank = int(fabric.world_size), int(fabric.rank)
    dev = fabric.device
    text = _text(settings)
    header = torch.tensor([MAGIC, _digest(text)], dtype=torch.int64)
    if rank == 0:
        differ = -1
        for src in range(1, n):
            h = yield from _receive(inbox, torch.zeros(2, dtype=torch.int64, device=dev), src, ("header", src))
            h = h.cpu()
            if int(h[0]) != MAGIC:
                raise MalformedMessage(f"{what}: worker {src} sent a settings header of another protocol or "
                                       f"version (magic {int(h[0]):#x}); this is worker 0")
            if differ < 0 and int(h[1]) != int(header[1]):
                differ = src
        decision = torch.tensor([MAGIC, int(differ >= 0), differ], dtype=torch.int64)
        for dst in range(1, n):
            yield from _send(decision.to(dev), dst)
    else:
        yield from _send(header.to(dev), 0)
        decision = yield from _receive(inbox, torch.zeros(3, dtype=torch.int64, device=dev), 0, "decision")
        decision = decision.cpu()
    magic, status, r = (int(x) for x in decision)
    if magic != MAGIC or status not in (0, 1) or (status == 1 and not 1 <= r < n):
        raise MalformedMessage(f"{what}: a malformed settings decision from worker 0 ({decision.tolist()}); "
                               f"this is worker {rank} of {n}")
    if status == 0:
        return
    mine = _pack(text).to(dev)
    first, theirs = (torch.zeros(TEXT_BYTES, dtype=torch.uint8, device=dev) for _ in range(2))
    if rank == 0:
        first = mine
        yield from _receive(inbox, theirs, r, "text")
        for dst in range(1, n):
            yield from _send(first, dst)
            yield from _send(theirs, dst)
    else:
        if rank == r:
            yield from _send(mine, 0)
        yield from _receive(inbox, first, 0, "first")
        yield from _receive(inbox, theirs, 0, "theirs")
    raise _error(what, _lines(first), _lines(theirs), r, rank)
