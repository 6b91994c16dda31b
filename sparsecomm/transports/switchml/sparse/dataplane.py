"""The switch program of ``sparse-switch``: SwitchML's slot pool with OmniReduce's look-ahead.

The design, the pipeline sketch and the arithmetic are in :mod:`sparsecomm.transports.switchml.sparse`; this module is the
program itself (registers and per-packet action), its wire format and its service loop.

Registers (``S`` slots, two sets per slot as SwitchML, ``k`` values per slot; :data:`REGISTERS`
declares them with their widths, and :meth:`Dataplane.state_bits` measures what the emulation holds):

- ``values[S, 2, k]`` int32 accumulators (fixed-point codes; also the element-wise minimum of a
  look-ahead round);
- ``seen[S, 2, B/64]`` the worker bitmap, ``B`` bits (the program's ``workers``, a multiple of 64: 64 unless a
  job has more workers), kept as 64-bit words of which a packet reads and writes only its worker's
  (``w div 64``, a register pair addressed by slot, set and word: one register ALU per pass however wide);
  ``count[S, 2]`` contributions still missing (``log2 B + 1`` bits: 7 for 64 workers);
- ``nxt[S, 2]`` the minimum next position announced in the round (32 bits);
- ``pos[S, 2]`` the lane position the round aggregates (32 bits; a packet for another position
  while the round is open is refused, counted as ``"out_of_step"``);
- ``held[S, 2]`` one bit: some worker contributed data (a result without it is counted as
  ``"empty"`` -- the protocol never produces one).

A malformed packet (a type, slot, set, worker id, worker count -- it must equal the job's, known from the
fabric -- or width the program cannot match, or a next position not after the packet's own) is dropped
and counted (``"malformed"``), as a P4 parser drops it; an out-of-step one is refused (``"out_of_step"``).
Neither reaches a register or a multicast, and both are *reported*: the service tells every worker (a
``REJECT`` row naming the worker whose port the packet came on, the reason and the count,
:func:`rejection`), and every worker stops the job (``MalformedMessage`` / ``ProtocolError`` naming that
worker). No worker of this library sends either (on FIFO links a round's packets all carry its
position), and the switch cannot tell a forged extra packet from a corrupted one that a round needs:
a needed contribution that never arrives would leave every worker waiting for its slot until the
timeout.

Per packet ``(type, slot s, set v, worker w, n, pos p, next m, [vector])``, ``u = w div 64`` its bitmap word::

    before = seen[s,v,u]; seen[s,v,u] |= bit(w); seen[s,1-v,u] &= ~bit(w)   # as SwitchML: w consumed set 1-v
    if w not in before:
        if count == 0:  values = vector or 0; nxt = m; pos = p; held = has_vector; count = n-1
        else:           values = values + vector   (MIN round: min(values, vector));
                        nxt = min(nxt, m); held |= has_vector; count -= 1
        if count == 0:  multicast (values, pos, nxt) to the n workers
    elif count == 0:    unicast the stored result to w          # a retransmission after completion
    else:               drop

A round's first packet is the first new one after the set's last round completed (``count == 0``): every
worker's bit of that set was cleared by its packet to the other set, which it sent only after the result, so
no register needs a scan of the whole bitmap (with one word, ``n <= 64``, this is SwitchML's ``before == 0``).

Wire format: int32 words. Every packet starts with the 4-word header ``[W0, SLOT, POS, NEXT]``
(``W0`` packs ``type:3 | set:1 | worker:6 | n:7 | job:12``, the low bits of the worker id and count;
``SLOT`` packs ``slot:16 | worker_hi:5 | n_hi:5``, their high bits, zero up to 64 workers, and six zero
bits); a DATA, MIN or RESULT packet carries ``k`` values after it (``HEADER + k`` words, on ``TAG_UP`` /
``TAG_DOWN``); a SKIP packet is the header alone (``TAG_SKIP``): a worker that does not hold the round's
block still reports its look-ahead, in 16 bytes (on real fabrics padded to a value packet, see
:meth:`Dataplane.roles`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Callable, Generator, NamedTuple

import numpy as np
import torch
from numba import njit

from ....fabric import services
from ....fabric.base import Fabric
from ....fabric.roles import Inbox, Outbox, Pool, Step
from ....errors import InvalidValueError
from ... import defaults
from .requests import Datagrams, RecvFor, lowered

# ----------------------------------------------------------------------------- wire format
W0, F_SLOT, F_POS, F_NEXT = range(4)
HEADER = 4


class Kind(IntEnum):
    """Packet types (``W0 & 7``)."""

    EMPTY = 0        # an unused row of a burst
    DATA = 1         # worker -> switch: a block's codes (added) with the sender's look-ahead
    SKIP = 2         # worker -> switch: no block, the sender's pending look-ahead (header only)
    MIN = 3          # worker -> switch: a look-ahead round vector (element-wise minimum)
    RESULT = 4       # switch -> workers: a completed round (multicast)
    RETRANSMIT = 5   # switch -> one worker: a completed round again, for a duplicate
    REJECT = 6       # switch -> every worker: it dropped packets of worker ``worker`` (their port)


T_EMPTY, T_DATA, T_SKIP, T_MIN, T_RESULT, T_RETRANSMIT, T_REJECT = (int(k) for k in Kind)
#: why the switch dropped a packet (a REJECT row's ``pos``; its ``next`` is how many the message held)
MALFORMED, OUT_OF_STEP = 1, 2
TYPES_UP = (T_DATA, T_SKIP, T_MIN)
TAG_UP, TAG_SKIP, TAG_DOWN = 0x5B51, 0x5B53, 0x5B52

NONE = 2**31 - 1                  # "no next block in this lane": larger than any position
MAX_WORKERS = 1024                # the widest worker bitmap a program takes (module docstring, Registers)
WORD = 64                         # bits per bitmap word (a register pair, as SwitchML pairs its values)
PACKET_ELEMS = (64, 256)          # as SwitchML: one pass, or four with recirculation
DEFAULT_SLOTS = 1024
JOB_MASK = 0xFFF
MAX_BURST = 1024                  # packets per fabric message at most
_SERVICE_KEEP = 256               # the switch's replies left unreaped (real fabrics)

#: fields of the header a worker reads from every result: ``W0 & KIND_BITS`` its type, ``(W0 >> SET_SHIFT) & 1``
#: its set, ``(W0 >> JOB_SHIFT) & JOB_MASK`` its job, ``SLOT & SLOT_BITS`` its slot (:class:`Header`)
KIND_BITS, SET_SHIFT, JOB_SHIFT, SLOT_BITS = 0x7, 3, 17, 0xFFFF
_TYPE_BITS, _SET_SHIFT, _WORKER_SHIFT, _NW_SHIFT, _JOB_SHIFT = KIND_BITS, SET_SHIFT, 4, 10, JOB_SHIFT
_SLOT_BITS, _WORKER_HI, _NW_HI, _HI_BITS = SLOT_BITS, 16, 21, 0x1F    # the SLOT word: slot, high bits of worker, n


def registers(workers: int = WORD) -> dict:
    """The program's registers for a bitmap of ``workers`` bits: name -> (entries per slot, bits per entry)
    (``None`` entries: ``2 k`` values). ``seen`` holds ``2 workers / 64`` words of 64 bits."""
    return {"values": (None, 32), "seen": (2 * (workers // WORD), WORD), "count": (2, workers.bit_length()),
            "nxt": (2, 32), "pos": (2, 32), "held": (2, 1)}


#: the registers of a program for up to 64 workers (the default)
REGISTERS = registers()


def pack_w0(kind, set_, worker, nw, job) -> np.ndarray | int:
    """The first header word (vectorised over numpy arrays): the low 6 bits of ``worker`` and 7 of ``nw``
    (the rest go in the SLOT word, :class:`Header`)."""
    return (kind | (set_ << _SET_SHIFT) | ((worker & 0x3F) << _WORKER_SHIFT) | ((nw & 0x7F) << _NW_SHIFT)
            | ((job & JOB_MASK) << _JOB_SHIFT))


def unpack_w0(w0):
    """``(type, set, worker, n, job)`` of first header words (vectorised; the low bits of worker and n)."""
    w0 = np.asarray(w0, dtype=np.int64)
    return (w0 & _TYPE_BITS, (w0 >> _SET_SHIFT) & 1, (w0 >> _WORKER_SHIFT) & 0x3F,
            (w0 >> _NW_SHIFT) & 0x7F, (w0 >> _JOB_SHIFT) & JOB_MASK)


class Header(NamedTuple):
    """A packet's header, decoded: what every endpoint reads before it uses a packet (the worker id and count
    from their low bits in ``W0`` and high bits in the SLOT word; ``rest``: the SLOT word's top six bits,
    zero in every packet of this library)."""

    kind: int
    set: int
    worker: int
    n: int
    job: int
    slot: int
    pos: int
    next: int
    rest: int = 0

    @classmethod
    def of(cls, row: np.ndarray) -> "Header":
        kind, set_, worker, n, job = (int(a) for a in unpack_w0(row[W0]))
        sw = int(row[F_SLOT]) & 0xFFFFFFFF
        return cls(kind, set_, worker | ((sw >> _WORKER_HI) & _HI_BITS) << 6, n | ((sw >> _NW_HI) & _HI_BITS) << 7,
                   job, sw & _SLOT_BITS, int(row[F_POS]), int(row[F_NEXT]), sw >> (_NW_HI + 5))

    def write(self, row: np.ndarray) -> np.ndarray:
        row[W0] = pack_w0(self.kind, self.set, self.worker, self.n, self.job)
        row[F_SLOT] = self.slot | (self.worker >> 6) << _WORKER_HI | (self.n >> 7) << _NW_HI
        row[F_POS], row[F_NEXT] = self.pos, self.next
        return row


@dataclass(frozen=True)
class SparseSwitchConfig:
    """Compile-time constants of the program; they name the service (``"sparse-switch:elems=64"``).
    ``burst``: packets per fabric message (a burst's rows are processed one by one, each with its own slot
    semantics); ``None``: the fabric's (:meth:`on`, :mod:`...defaults`: one where a message is a datagram of
    a modelled network, else as many as fill a 1 MiB message, 1024 of 256 values), which the switch rank
    and its workers resolve alike. ``audit``: count every accepted contribution by ``(job, min round?,
    slot, pos, worker)`` (tests only). ``workers``: the width of the worker bitmap, the most workers a job may
    have (a multiple of 64, at most :data:`MAX_WORKERS`); ``None``: the job's workers rounded up to a multiple
    of 64 (at least 64), resolved by :meth:`on` alike on the switch and its workers (left ``None`` up to 64
    workers)."""

    NAME = "sparse-switch"

    elems: int = 256
    slots: int = DEFAULT_SLOTS
    burst: int | None = None
    audit: bool = False
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.elems not in PACKET_ELEMS:
            raise InvalidValueError(f"slot_elems must be one of {PACKET_ELEMS} (the switch's packet sizes), "
                             f"got {self.elems!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or not 2 <= self.slots <= 1 << 16:
            raise InvalidValueError(f"switch slots must be an integer in [2, 65536], got {self.slots!r}")
        if self.burst is not None and (isinstance(self.burst, bool) or not isinstance(self.burst, int)
                                       or not 1 <= self.burst <= MAX_BURST):
            raise InvalidValueError(f"burst must be an integer in [1, {MAX_BURST}], got {self.burst!r}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or not WORD <= self.workers <= MAX_WORKERS or self.workers % WORD):
            raise InvalidValueError(f"workers (the switch's worker bitmap) must be a multiple of {WORD} in "
                                    f"[{WORD}, {MAX_WORKERS}], got {self.workers!r}")

    @property
    def width(self) -> int:
        """The worker bitmap's bits: ``workers``, or 64 before :meth:`on` resolved it."""
        return self.workers or WORD

    def on(self, fabric: Fabric) -> "SparseSwitchConfig":
        """This program on ``fabric``: ``burst`` left ``None`` takes the fabric's default, ``workers`` left
        ``None`` the job's worker count rounded up to a multiple of 64 where it is more than 64 (at most
        :data:`MAX_WORKERS`: a larger job is refused by the transport)."""
        burst = self.burst if self.burst is not None else defaults.packets_per_message(fabric, self.elems, MAX_BURST)
        workers = self.workers
        if workers is None and fabric.world_size > WORD:     # (up to 64 workers: left None, the 64-bit program)
            workers = min(MAX_WORKERS, -(-fabric.world_size // WORD) * WORD)
        if (burst, workers) == (self.burst, self.workers):
            return self
        return replace(self, burst=burst, workers=workers)

    def spec(self) -> str:
        """The service spec naming this program: ``"sparse-switch"`` for the defaults."""
        return services.config_spec("sparse-switch", self)

    @classmethod
    def parse(cls, arg: str | None) -> "SparseSwitchConfig":
        """Inverse of :meth:`spec` for the part after ``sparse-switch:`` (a bare integer means ``elems``)."""
        return services.parse_config(cls, "sparse-switch", arg, bare="elems")



# ----------------------------------------------------------------------------- the program, compiled
#: what :func:`_program` did with a packet (its return value's low byte), and the counter it adds to
_MALFORMED, _OUT_OF_STEP, _CONSUMED, _DUPLICATE, _DROPPED = range(5)
_EVENTS = ("malformed", "out_of_step", "consumed", "retransmit", "dropped")
#: flags of a consumed packet: it completed the round (multicast), the round held no data, an add wrapped
_COMPLETE, _EMPTY, _OVERFLOW = 1 << 9, 1 << 10, 1 << 11


@njit(cache=True, nogil=True)
def _program(row, values, seen, count, nxt, pos, held, width, world):  # pragma: no cover - numba
    """The per-packet action of the module docstring on ``row`` (int32: a header, or a header and ``k``
    values) against the registers; ``width``: the bitmap's bits, ``world``: the job's workers (-1: not
    known). Returns ``event | set << 8 | flags | slot << 16``: the event (:data:`_EVENTS`: malformed,
    out of step, consumed, a duplicate after completion -- to be answered with the stored result -- or
    dropped), the packet's set and slot where it was parsed, and for a consumed packet the flags
    :data:`_COMPLETE` (multicast the result), :data:`_EMPTY` (a completed round without data) and
    :data:`_OVERFLOW` (an add wrapped, as the hardware's: the agreed scale prevents it). A malformed or
    out-of-step packet changes no register."""
    slots, elems = values.shape[0], values.shape[2]
    w0 = np.int64(row[W0])
    kind = w0 & _TYPE_BITS
    v = (w0 >> _SET_SHIFT) & 1
    sw = np.int64(row[F_SLOT]) & 0xFFFFFFFF
    w = ((w0 >> _WORKER_SHIFT) & 0x3F) | (((sw >> _WORKER_HI) & _HI_BITS) << 6)
    n = ((w0 >> _NW_SHIFT) & 0x7F) | (((sw >> _NW_HI) & _HI_BITS) << 7)
    slot = sw & _SLOT_BITS
    p = np.int64(row[F_POS])
    m = np.int64(row[F_NEXT])
    skip = kind == T_SKIP
    if not ((kind == T_DATA or kind == T_SKIP or kind == T_MIN) and slot < slots and 0 <= w and w < n
            and n <= width and (sw >> (_NW_HI + 5)) == 0 and (world < 0 or n == world)
            and row.shape[0] == (HEADER if skip else HEADER + elems) and 0 <= p and (kind == T_MIN or p < m)):
        return _MALFORMED
    tag = (v << 8) | (slot << 16)
    u = w >> 6
    bit = np.uint64(1) << np.uint64(w & 63)
    before = seen[slot, v, u]
    c = count[slot, v]
    if c != 0 and (before & bit) == 0 and pos[slot, v] != p:
        return _OUT_OF_STEP | tag
    seen[slot, v, u] = before | bit
    seen[slot, 1 - v, u] &= ~bit
    if (before & bit) != 0:
        return (_DUPLICATE if c == 0 else _DROPPED) | tag
    acc = values[slot, v]
    flags = 0
    if c == 0:                                # the round's first packet (module docstring)
        if skip:
            for j in range(elems):
                acc[j] = 0
        else:
            for j in range(elems):
                acc[j] = row[HEADER + j]
        nxt[slot, v] = m
        pos[slot, v] = p
        held[slot, v] = not skip
        count[slot, v] = n - 1
    else:
        if kind == T_MIN:
            for j in range(elems):
                b = row[HEADER + j]
                if b < acc[j]:
                    acc[j] = b
        elif kind == T_DATA:                  # add, wrapping as the hardware's; wrapped iff both addends'
            wrapped = np.int32(0)             # signs differ from the sum's
            for j in range(elems):
                a = acc[j]
                b = row[HEADER + j]
                s = np.int32(np.uint32(a) + np.uint32(b))
                wrapped |= (a ^ s) & (b ^ s)
                acc[j] = s
            if wrapped < 0:
                flags |= _OVERFLOW
        if m < nxt[slot, v]:
            nxt[slot, v] = m
        if not skip:
            held[slot, v] = True
        count[slot, v] = c - 1
    if count[slot, v] == 0:
        flags |= _COMPLETE
        if not held[slot, v]:
            flags |= _EMPTY
    return _CONSUMED | tag | flags


@njit(cache=True, nogil=True)
def _burst(arr, start, burst, values, seen, count, nxt, pos, held, width, world, mc, uc, ends,
           counters):  # pragma: no cover - numba
    """:func:`_program` on the rows of one message ``arr`` (``R`` rows of ``HEADER + k`` words) from row
    ``start`` on, in order, as :meth:`Dataplane.process` runs it row by row: with ``burst`` ``T_EMPTY`` rows
    are passed over and a skip's row is its header (:meth:`Dataplane.packets`); else the one row is taken
    whole (one packet per message). A completed round's result (:meth:`Dataplane._result`) is written to
    ``mc[ends[0]]``, a duplicate's after completion to ``uc[ends[1]]`` (``ends`` counts them); ``counters``
    adds ``packets`` and each event of :data:`_EVENTS` (in that order), then ``overflow``, ``empty`` and
    ``multicast``. Returns the index of the first row the caller must run itself (a malformed or out-of-step
    one, whose report reads the registers as the program left them: :func:`_program` changed none), or
    ``R`` when every row is done."""
    elems = values.shape[2]
    keep = (0x3F << _WORKER_SHIFT) | (0x7F << _NW_SHIFT) | (JOB_MASK << _JOB_SHIFT)
    hi = (_HI_BITS << _WORKER_HI) | (_HI_BITS << _NW_HI)
    for r in range(start, arr.shape[0]):
        kind = arr[r, W0] & _TYPE_BITS
        if burst and kind == T_EMPTY:
            continue
        row = arr[r, :HEADER] if burst and kind == T_SKIP else arr[r]
        code = _program(row, values, seen, count, nxt, pos, held, width, world)
        event = code & 0xFF
        if event == _MALFORMED or event == _OUT_OF_STEP:
            return r
        counters[0] += 1
        counters[1 + event] += 1
        if event == _CONSUMED:
            if code & _OVERFLOW:
                counters[6] += 1
            if not code & _COMPLETE:
                continue
            if code & _EMPTY:
                counters[7] += 1
            counters[8] += 1
            out = mc[ends[0]]
            ends[0] += 1
            rkind = T_RESULT
        elif event == _DUPLICATE:
            out = uc[ends[1]]
            ends[1] += 1
            rkind = T_RETRANSMIT
        else:
            continue
        slot = (code >> 16) & 0xFFFF
        v = (code >> 8) & 1
        out[W0] = rkind | (v << _SET_SHIFT) | (row[W0] & keep)
        out[F_SLOT] = slot | (row[F_SLOT] & hi)
        out[F_POS] = pos[slot, v]
        out[F_NEXT] = nxt[slot, v]
        acc = values[slot, v]
        for j in range(elems):
            out[HEADER + j] = acc[j]
    return arr.shape[0]


#: what :func:`_burst` counts, in its order
_BURST_COUNTS = ("packets",) + _EVENTS + ("overflow", "empty", "multicast")


class Dataplane:
    """Registers and the per-packet action of the sparse switch (module docstring)."""

    def __init__(self, config: SparseSwitchConfig = SparseSwitchConfig()) -> None:
        self.config = config
        s, k = config.slots, config.elems
        self.values = np.zeros((s, 2, k), dtype=np.int32)
        self.seen = np.zeros((s, 2, config.width // WORD), dtype=np.uint64)
        self.count = np.zeros((s, 2), dtype=np.int16)
        self.nxt = np.zeros((s, 2), dtype=np.int32)
        self.pos = np.zeros((s, 2), dtype=np.int32)
        self.held = np.zeros((s, 2), dtype=np.bool_)
        self.stats = Counter()                 # packet counters (not switch state)
        self.audit: Counter | None = Counter() if config.audit else None
        #: the job's number of workers, known from the fabric once serving; a packet claiming another
        #: worker count is malformed (never multicast to ranks that do not exist)
        self.world: int | None = None
        #: the last packet refused as out of step: ``(slot, its position, the round's position, the
        #: round's bitmap word of the refused packet's worker, that word's index)``, what the rejection notice
        #: tells the workers (packet metadata, no register)
        self.refused: tuple[int, int, int, int, int] | None = None

    # ------------------------------------------------------------------ declared vs held state
    def declared_bits(self) -> int:
        """Register memory the program declares (:func:`registers` of its bitmap's width), in bits."""
        s, k = self.config.slots, self.config.elems
        return sum(s * (2 * k if per is None else per) * bits for per, bits in registers(self.config.width).values())

    def state_bits(self) -> int:
        """Register memory the emulation holds: every array attribute, at its declared width; raises
        if an array is not a declared register, is larger than declared, or holds a value that does
        not fit its declared width."""
        s, k = self.config.slots, self.config.elems
        declared = registers(self.config.width)
        total = 0
        for name, val in vars(self).items():
            if not isinstance(val, np.ndarray):
                continue
            if name not in declared:
                raise AssertionError(f"sparse switch holds an undeclared array {name!r} {val.shape}")
            per, bits = declared[name]
            want = (s, 2 * k if per is None else per)
            if (val.shape[0], int(np.prod(val.shape[1:]))) != want:
                raise AssertionError(f"register {name!r} has shape {val.shape}, declared {want} entries")
            if val.size and val.dtype != np.bool_ and bits < 64:
                v = val.astype(np.int64)
                lo = -(1 << (bits - 1)) if val.dtype.kind == "i" and bits == 32 else 0
                hi = (1 << bits) - 1 if lo == 0 else (1 << (bits - 1)) - 1
                if v.min() < lo or v.max() > hi:
                    raise AssertionError(f"register {name!r} holds values outside its {bits}-bit width")
            total += val.size * bits
        return total

    # ------------------------------------------------------------------ the program
    def process(self, row: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Run the program on one packet (a header, or a header and ``k`` values); returns
        ``(row to multicast, row to unicast)``, either ``None``. Malformed packets are dropped and
        counted (``stats["malformed"]``), as a parser drops what it cannot match. The registers' part is
        one compiled call (:func:`_program`); a result row is built by :meth:`_result`."""
        cfg = self.config
        if row.dtype != np.int32 or row.ndim != 1:
            row = np.ascontiguousarray(row, dtype=np.int32).reshape(-1)
        world = self.world
        code = _program(row, self.values, self.seen, self.count, self.nxt, self.pos, self.held, cfg.width,
                        -1 if world is None else world)
        stats = self.stats
        stats["packets"] += 1
        event = code & 0xFF
        stats[_EVENTS[event]] += 1
        if event == _MALFORMED:
            return None, None
        if event == _OUT_OF_STEP:            # (the registers as the program found them: it changed none)
            h = Header.of(row)
            slot, v, u = h.slot, h.set, h.worker // WORD
            self.refused = (slot, h.pos, int(self.pos[slot, v]), int(self.seen[slot, v, u]), u)
            return None, None
        if event == _DUPLICATE:
            return None, self._result(row, code >> 16, (code >> 8) & 1, T_RETRANSMIT)
        if event == _CONSUMED:
            if code & _OVERFLOW:
                stats["overflow"] += 1       # hardware wraps; the agreed scale prevents it
            if self.audit is not None:
                h = Header.of(row)
                self.audit[(h.job, h.kind == T_MIN, h.slot, h.pos, h.worker)] += 1
            if code & _COMPLETE:
                if code & _EMPTY:
                    stats["empty"] += 1
                stats["multicast"] += 1
                return self._result(row, code >> 16, (code >> 8) & 1, T_RESULT), None
        return None, None

    def _result(self, row: np.ndarray, slot: int, v: int, kind: int) -> np.ndarray:
        """The result of ``slot``'s set ``v`` (its registers) as a ``kind`` row answering packet ``row``: the
        packet's header with the type, set, slot, the round's position and its next position, then the
        values."""
        out = np.empty(HEADER + self.config.elems, dtype=np.int32)
        w0, sw = int(row[W0]), int(row[F_SLOT]) & 0xFFFFFFFF
        out[W0] = (kind | (v << _SET_SHIFT) | (w0 & ((0x3F << _WORKER_SHIFT) | (0x7F << _NW_SHIFT)
                                                      | (JOB_MASK << _JOB_SHIFT))))
        out[F_SLOT] = slot | (sw & ((_HI_BITS << _WORKER_HI) | (_HI_BITS << _NW_HI)))
        out[F_POS] = self.pos[slot, v]
        out[F_NEXT] = self.nxt[slot, v]
        out[HEADER:] = self.values[slot, v]
        return out

    # ------------------------------------------------------------------ service loop
    def serve(self, fabric: Fabric) -> None:
        """The switch's endpoint until the run ends: its roles (:meth:`roles`) run by ``Fabric.drive``
        (their datagrams lowered by :func:`.requests.lowered`); ``ServiceShutdown`` ends it."""
        pool = Pool()
        inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
        fabric.drive([lowered(r, fabric, inbox, outbox, _SERVICE_KEEP) for r in self.roles(fabric)],
                     inbox, outbox, keep=_SERVICE_KEEP)

    def serve_process(self, fabric: Fabric) -> Generator:
        """:meth:`serve` as a process of the loop of a fabric with modelled time (``Fabric.drive_process``):
        no thread."""
        pool = Pool()
        inbox, outbox = Inbox(fabric, pool), Outbox(fabric, pool)
        yield from fabric.drive_process([lowered(r, fabric, inbox, outbox, _SERVICE_KEEP) for r in self.roles(fabric)],
                                        inbox, outbox, _SERVICE_KEEP)

    def roles(self, fabric: Fabric) -> list:
        """The switch's ports as roles (:mod:`sparsecomm.fabric.roles`, with :class:`.requests.Datagram`), which
        never return: receive a packet, run the program, multicast / unicast the replies.

        On SimFabric (one packet per datagram) two roles, one per tag, each waiting for an any-source receive:
        value packets on ``TAG_UP`` and 16-byte skip headers on ``TAG_SKIP``, whichever is in first
        in modelled time served first (the value packets' on a tie), also while the switch is busy past both
        (the SimFabric's choice on a ``per_port`` endpoint): a port is one queue, and a worker's retransmission
        taken after its packet of the slot's next round would be counted as that set's next round (the seen
        bitmap's rule assumes a port's packets in order, as SwitchML's); replies are sent ``tracked=False`` (never
        waited for: the ports transmit in parallel). With bursts (real fabrics, where a message costs far
        more than its bytes; or a burst set on SimFabric) on a real fabric one role per worker, its port, each with a
        receive from that worker posted whenever it is not running the program on that worker's last message, so
        that every worker's message of a wave comes in at once (over gloo a message leaves only for a posted
        receive, and a receive from any worker takes one worker's message at a time: a wave of ``n`` workers'
        messages would come in one after another); the roles take turns in one thread, each worker's messages in
        order. On SimFabric one role with a receive from any worker, which takes the messages in the order they
        arrive in modelled time (its messages arrive in parallel: the model has no rendezvous). A message is up
        to ``burst`` rows of
        ``HEADER + k`` words, skips padded (a receive of ``burst`` rows, every row ``T_EMPTY`` when posted,
        takes a shorter message: :mod:`..lanes`); the replies to a message's rows leave in messages of up to
        ``burst`` rows, reaped by the scheduler before its next wait (all but :data:`_SERVICE_KEEP`) except on
        SimFabric. Malformed and out-of-step packets are reported to every worker (module docstring)."""
        k, K = self.config.elems, self.config.burst
        width = HEADER + k
        sim = fabric.modelled_time
        self.world = fabric.world_size
        if K == 1 and sim:
            return [self._port(fabric, ("up", tag), torch.zeros(w, dtype=torch.int32), tag, Step(phase))
                    for phase, (tag, w) in enumerate(((TAG_UP, width), (TAG_SKIP, HEADER)))]
        if sim:
            return [self._port(fabric, ("up", TAG_UP), torch.zeros((K, width), dtype=torch.int32), TAG_UP,
                               Step(0, reaps=True))]
        return [self._port(fabric, ("up", TAG_UP, w), torch.zeros((K, width), dtype=torch.int32), TAG_UP,
                           Step(0, reaps=True), w) for w in range(self.world)]

    def _port(self, fabric: Fabric, key, buf: torch.Tensor, tag: int, stage: Step, port: int | None = None):
        """One of :meth:`roles`: packets on ``tag`` from worker ``port`` (``None``: any worker) into ``buf`` (one
        row, or ``burst`` rows), under inbox ``key``, waiting at ``stage`` (:class:`.requests.RecvFor` without a
        timer: the port they came on is the source it resumes with)."""
        K = self.config.burst
        sim = fabric.modelled_time
        single = buf.dim() == 1
        arr = buf.numpy()
        while True:
            src = yield RecvFor(key, buf, port, tag, None, stage)
            if single:
                packets, valued = 1, int(arr.size > HEADER)
            else:
                kinds = arr[:, W0] & _TYPE_BITS
                packets = int(np.count_nonzero(kinds))
                valued = packets - int(np.count_nonzero(kinds == T_SKIP))
            fabric.host_work("sparse_switch_message", 1)
            fabric.host_work("sparse_switch_packet", packets)
            fabric.host_work("sparse_switch_value", valued)
            sends, results = self.answer(arr, src, K, sim and fabric.message_bytes is None)
            fabric.host_work("sparse_switch_result", results)
            if sends:
                yield Datagrams(sends, TAG_DOWN, tracked=not sim)

    @staticmethod
    def packets(arr: np.ndarray) -> list[np.ndarray]:
        """The packets of a message received into ``arr`` (one row, or a burst of rows), copied out of it; a
        burst's rows are ``T_EMPTY`` again afterwards (the next message may be shorter) and a skip's row is
        its header."""
        if arr.ndim == 1:
            return [arr.copy()]
        kinds = unpack_w0(arr[:, W0])[0]
        rows = [arr[r, :HEADER].copy() if kinds[r] == T_SKIP else arr[r].copy()
                for r in np.flatnonzero(kinds != T_EMPTY)]
        arr[:, W0] = 0
        return rows

    def answer(self, arr: np.ndarray, src: int | None, K: int, pad: bool) -> tuple[list, int]:
        """:meth:`replies` to the message received into ``arr`` (one row, 1-D, or a burst of rows, 2-D) from
        ``src``, its rows run in one compiled call (:func:`_burst`) rather than one by one: the same replies,
        registers and counters. A malformed or out-of-step row is run by :meth:`process` (which counts it and
        records the refusal: the compiled call stops before it and goes on after it); with the audit on, every
        row is (:meth:`packets`, :meth:`replies`). A burst's rows are ``T_EMPTY`` again afterwards (the next
        message may be shorter). The replies are rows of the program's own arrays, split into messages as
        :meth:`replies` splits them (``pad``: a burst's last message padded to ``K`` rows)."""
        single = arr.ndim == 1
        if self.audit is not None:
            return self.replies(self.packets(arr), src, K, single, pad)
        k, world = self.config.elems, self.world
        width = HEADER + k
        rows = arr.reshape(1, -1) if single else arr
        R = rows.shape[0]
        mc = np.empty((R, width), dtype=np.int32)
        uc = np.empty((R, width), dtype=np.int32)
        ends = np.zeros(2, dtype=np.int64)
        counters = np.zeros(len(_BURST_COUNTS), dtype=np.int64)
        stats = self.stats
        before = stats["malformed"], stats["out_of_step"]
        r = 0
        while r < R:
            r = _burst(rows, r, not single, self.values, self.seen, self.count, self.nxt, self.pos, self.held,
                       self.config.width, -1 if world is None else world, mc, uc, ends, counters)
            if r < R:                         # malformed or out of step: no register changed, no reply
                row = rows[r]
                self.process(row[:HEADER] if not single and row[W0] & _TYPE_BITS == T_SKIP else row)
                r += 1
        if not single:
            arr[:, W0] = 0
        for name, c in zip(_BURST_COUNTS, counters.tolist()):
            if c:
                stats[name] += c
        nmc, nuc = (int(e) for e in ends)
        return self._sends(mc[:nmc], uc[:nuc], src, K, single, pad, before), nmc + nuc

    def replies(self, rows: list, src: int | None, K: int, single: bool, sim: bool) -> tuple[list, int]:
        """Run the program on ``rows`` (a message from ``src``, :meth:`packets`); its replies as ``(message,
        destinations, reliable)`` (:class:`.requests.Datagrams`; every worker: ``range(world)``): a rejection
        notice to every worker first if the message held a malformed or out-of-step packet, then the results to
        every worker, then the retransmissions to ``src`` (``(src,)``); and the
        result rows the program produced (multicast and retransmitted: what the host model charges
        ``sparse_switch_result_s`` for). ``K``: rows per reply message; ``single``: one row per message;
        ``sim``: a burst's last message padded to ``K`` rows (:func:`_split`: a SimFabric whose receive takes
        no shorter message, ``message_bytes`` None; a real fabric's, and a SimFabric's with real hosts', is as
        long as its rows)."""
        width = HEADER + self.config.elems
        mcast: list = []
        ucast: list = []
        before = self.stats["malformed"], self.stats["out_of_step"]
        for row in rows:
            mc, uc = self.process(row)
            if mc is not None:
                mcast.append(mc)
            if uc is not None:
                ucast.append(uc)
        return (self._sends(_rows(mcast, width), _rows(ucast, width), src, K, single, sim, before),
                len(mcast) + len(ucast))

    def _sends(self, mc: np.ndarray, uc: np.ndarray, src: int | None, K: int, single: bool, pad: bool,
               before: tuple[int, int]) -> list:
        """The replies of a message from ``src`` whose results are the rows of ``mc`` (to every worker) and
        ``uc`` (retransmissions, to ``src``), as ``(message, destinations, reliable)``: a rejection notice to
        every worker first if :attr:`stats` counted malformed or out-of-step packets since ``before`` (their
        counts then), then the results, then the retransmissions (:func:`_split`: ``K``, ``single``, ``pad``)."""
        world = self.world
        everyone = range(world)
        sends = [(msg, everyone, False) for msg in _split(mc, K, single, pad)]
        if src is not None:
            sends += [(msg, (src,), False) for msg in _split(uc, K, single, pad)]
        malformed, out_of_step = self.stats["malformed"] - before[0], self.stats["out_of_step"] - before[1]
        if (malformed or out_of_step) and src is not None and 0 <= src < world:
            notice = rejection(self.config.elems, src, world, OUT_OF_STEP if out_of_step else MALFORMED,
                               malformed + out_of_step, self.refused if out_of_step else None)
            sends = [(msg, everyone, True) for msg in _split(notice.reshape(1, -1), K, single, pad)] + sends
        return sends


def _rows(rows: list, width: int) -> np.ndarray:
    """Reply rows (each ``width`` int32 words) as the rows of one array (:func:`_split` makes the messages)."""
    return np.stack(rows) if rows else np.empty((0, width), dtype=np.int32)


def _split(rows: np.ndarray, K: int, single: bool, pad: bool) -> list[torch.Tensor]:
    """Reply rows (the rows of one array) as fabric messages: one row each (``single``), or up to ``K`` rows each, a
    run of the array's rows (no copy), the last one padded to ``K`` rows (unused rows ``T_EMPTY``) with ``pad``
    (SimFabric: a message has its receive's shape), else as long as its rows (real fabrics: a receive of ``K``
    rows takes a shorter message)."""
    if single:
        return [torch.from_numpy(r) for r in rows]
    out = []
    for i in range(0, len(rows), K):
        part = rows[i:i + K]
        if pad and len(part) < K:
            msg = np.zeros((K, rows.shape[1]), dtype=np.int32)
            msg[:len(part)] = part
            part = msg
        out.append(torch.from_numpy(part))
    return out


def rejection(k: int, worker: int, world: int, reason: int, count: int,
              refused: tuple[int, int, int, int, int] | None = None) -> np.ndarray:
    """The ``REJECT`` row telling every worker that the switch dropped ``count`` packets that came on
    ``worker``'s port, for ``reason`` (:data:`MALFORMED` or :data:`OUT_OF_STEP`, in ``pos``; the count in
    ``next``). Out of step, ``refused`` (:attr:`Dataplane.refused`) travels too: the slot (in ``slot``), then
    as values the refused packet's position, the round's position, the round's bitmap word that holds the
    refused packet's worker (low and high 32 bits) and that word's index: the workers whose packets opened the
    round, which the refused packet contradicts (all of them up to 64 workers; beyond, those of that word: the
    program reads one word per packet)."""
    row = np.zeros(HEADER + k, dtype=np.int32)
    slot = 0
    if refused is not None:
        slot, pos, at, seen, u = refused
        row[HEADER:HEADER + 5] = np.array([pos, at, seen & 0xFFFFFFFF, seen >> 32, u],
                                          dtype=np.uint32).view(np.int32)
    Header(T_REJECT, 0, worker, world, 0, slot, reason, count).write(row)
    return row


def refusal(row: np.ndarray) -> tuple[int, int, int, list[int]]:
    """``(slot, refused position, the round's position, the round's workers in the word it reports)`` of an
    out-of-step ``REJECT`` row (:func:`rejection`)."""
    pos, at, lo, hi, u = (int(w) for w in row[HEADER:HEADER + 5].view(np.uint32))
    seen = lo | (hi << 32)
    return Header.of(row).slot, pos, at, [u * WORD + b for b in range(WORD) if seen >> b & 1]


def service_main(config: SparseSwitchConfig) -> Callable[[Fabric], None]:
    """A launcher-started switch rank's loop: a fresh program running ``config`` on the rank's fabric."""

    def main(fabric: Fabric) -> None:
        Dataplane(config.on(fabric)).serve(fabric)

    return main


@services.registry.register("sparse-switch")
def _service(arg: str | None) -> Callable[[Fabric], None]:
    return service_main(SparseSwitchConfig.parse(arg))
