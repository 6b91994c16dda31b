"""The switch endpoint of SwitchML-style in-network aggregation (Sapio et al., NSDI'21, arXiv 1903.06701).

A dataplane program holding only what a programmable switch can hold, following the public
implementation p4lang/p4app-switchML (``dev_root/p4/bitmap_checker.p4``, ``workers_counter.p4``,
``processor.p4``, ``exponents.p4``, ``controller/next_step_selector.py``): fixed register arrays of
``slots`` slots, each with **two sets** (the P4 pool index carries the set bit), every set holding

- ``values[slot, set, :]``: ``slot_elems`` int32 accumulators (64 per pass, 256 with recirculation);
- ``seen[slot, set]``: a 32-bit worker bitmap (hence at most 32 workers per job); a program compiled for
  more workers (``SwitchConfig.workers``, below) keeps ``seen[slot, set, word]``, one 32-bit word per 32
  workers;
- ``count[slot, set]``: contributions still missing;
- ``exponent[slot, set]``: the int8 maximum of the workers' exponents (quantisation, see ``switch.py``).

Per packet ``(slot, set v, worker w, n, exponent e, vector)``, as the P4 program does (the whole state
machine; :func:`_program` runs it, one compiled call per message)::

    before = seen[v]; seen[v] |= bit(w); seen[1-v] &= ~bit(w)     # w has consumed set 1-v's result
    if w not in before:                                           # a new contribution
        if before == 0: value = vector; exponent = e; count = n-1  # the first writer overwrites
        else:           value += vector; exponent = max(exponent, e); count -= 1
        if count == 0:  multicast (value, exponent) to the n workers
    elif count == 0:    unicast the stored result to w          # duplicate after completion
    else:               drop                                       # duplicate, slot still incomplete

Deviation, on purpose: the P4 ``workers_counter`` treats ``count == 0`` as "first packet"; here the
first writer is recognised by the bitmap (``before == 0``) and resets the count too. In normal
operation both coincide (a set's bitmap and count return to 0 together); keying on the bitmap means
a job abandoned half-way can never leave a stale count behind. The int32 adds wrap as the hardware's
do (counted in ``stats["overflow"]``: the workers' scale must prevent it).

**Past 32 workers: a multi-word bitmap.** The reference program's bitmap is one 32-bit register per slot and
set (``configuration.p4``: ``max_num_workers = 32``). A job of ``n > 32`` workers runs a program compiled
with ``W = ceil(n / 32)`` such registers (``workers = 32 W``): worker ``w``'s bit is bit ``w mod 32`` of word
``w // 32``, its packet reads and sets that word alone, and the first writer is recognised by every word of
the set being 0. On a switch, each further word is one more register array (one more stage's register
access: W is bounded by the pipeline's stages, which this model does not count); the adds, the count and
the exponent are unchanged, so one tree level of ``n`` ports aggregates ``n`` workers exactly as 32. (The
other way past the bitmap, a tree of switches each aggregating up to 32 workers, as ATP's hierarchical
aggregation does, Lao et al., NSDI'21, changes the topology and the loss recovery; not modelled here.)

Malformed input never reaches a register or a multicast: a packet of another type than ``DATA`` (or an
empty row), or whose slot, set, worker id or worker count (it must equal the job's, which the switch
knows from its fabric) is out of range is counted in ``stats["malformed"]`` and dropped, as a P4 parser
drops what it cannot match; one forged packet claiming 32 workers cannot make the switch send to ranks
that do not exist. It is also *reported*: the service tells every worker (a ``REJECT`` row naming the
worker whose port the packet came on, :func:`rejection`), and every worker stops the job with
:class:`~sparsecomm.errors.MalformedMessage` naming it. The switch cannot tell a forged extra packet
from a corrupted one that a job needs, and a needed contribution that never arrives would leave every
worker waiting for its slot until the timeout (as a peer whose messages were corrupted on the way did).
Nothing grows with the number of packets except the optional ``audit`` counter (test instrumentation,
not switch state).

Wire format: one int32 row per packet, ``HEADER`` fields (:class:`Field`) then ``slot_elems`` values; a
fabric message carries up to ``burst`` rows (on SimFabric exactly ``burst``, unused rows of type
``T_EMPTY``; on real fabrics as many as are ready, :mod:`.lanes`), workers -> switch on
``TAG_UP``, switch -> workers on ``TAG_DOWN``, all ``reliable=False``. How the rows reach the program
(one datagram per packet on SimFabric, per-port receive threads on real fabrics) is
:mod:`.service`.

**Header-only packets** (real fabrics): a packet that carries no values (a float job's exponent look-ahead,
:mod:`.jobs`) travels as its ``HEADER`` words alone, in a ``SHORT`` message (:func:`short_frame`): a first
row ``(SHORT, count, 0, ...)`` then ``count`` header rows, flat. The program takes such a packet as one
whose values are all zero (the first writer zeroes the slot's accumulators; its exponent counts as any
packet's) and answers it with a header-only result, in a ``SHORT`` message too. So the look-ahead costs
``4 * HEADER`` bytes a packet each way, not a whole packet's ``4 * (HEADER + slot_elems)``. SimFabric's own
datagrams keep the paper's program: every packet is a whole row, one datagram of the modelled network; a
SimFabric with a real fabric's messages (a host model's ``message_bytes``) sends ``SHORT`` ones as a real
fabric does (:func:`.service.switch_role`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np
from numba import njit

from ...fabric import services
from ...fabric.base import Fabric
from ...errors import InvalidValueError
from .. import defaults


# ----------------------------------------------------------------------------- wire format
class Field(IntEnum):
    """Header words of a packet row (int32 each)."""

    TYPE = 0      # :class:`PacketType`
    SLOT = 1      # switch slot (0: the control slot)
    SET = 2       # which of the slot's two sets (the pool index's set bit)
    WORKER = 3    # the sender's rank (its bit in the bitmap)
    PKT = 4       # packet number within the job's phase (-1: control); echoed in the result
    JOB = 5       # the workers' job counter; echoed
    NW = 6        # number of workers of the job (must equal the switch's world)
    EXP = 7       # worker: its chunk's exponent; switch: the slot's maximum


class PacketType(IntEnum):
    EMPTY = 0        # padding row of a burst
    DATA = 1         # worker -> switch: a contribution
    RESULT = 2       # switch -> workers: multicast of a completed slot
    RETRANSMIT = 3   # switch -> one worker: the stored result, for a duplicate after completion
    REJECT = 4       # switch -> every worker: it dropped packets of worker WORKER (their port) it cannot parse
    SHORT = 5        # real fabrics: a message of header-only packets (:func:`short_frame`), not a packet itself


F_TYPE, F_SLOT, F_SET, F_WORKER, F_PKT, F_JOB, F_NW, F_EXP = (int(f) for f in Field)
HEADER = len(Field)
T_EMPTY, T_DATA, T_RESULT, T_RETRANSMIT, T_REJECT, T_SHORT = (int(t) for t in PacketType)
#: a SHORT message's first row: the number of header rows that follow
F_SHORT_COUNT = F_SLOT
#: a REJECT row's fields: the worker whose port the packets came on, and how many the message held
F_REJECTED, F_REJECTED_COUNT = F_WORKER, F_JOB
TAG_UP = 0x5A51
TAG_DOWN = 0x5A52

MAX_WORKERS = 32                   # 32-bit worker bitmap (p4/configuration.p4: max_num_workers)
WIDEST = 1024                      # the most workers a program may be compiled for (32 words of bitmap)
PACKET_ELEMS = (64, 256)           # the P4 program accepts 64 (one pass) or 256 (recirculation)
DEFAULT_SLOTS = 8192               # 16384 register entries = 8192 slot pairs (configuration.p4)
EXP_MIN, EXP_MAX = -128, 127       # int8 exponent registers (exponents.p4)
RECV_SLACK = 4                     # real fabrics: a switch receive holds this many bursts (see .service)

#: the program's packet counters, in the order :func:`_program` keeps them
COUNTERS = ("packets", "malformed", "consumed", "multicast", "retransmit", "dropped", "overflow")


@dataclass(frozen=True)
class SwitchConfig:
    """Compile-time constants of the switch program; they name the service (``"switch:elems=256"``).

    ``elems`` (values per packet) and ``burst`` (packets per fabric message) left ``None`` are the
    fabric's (:meth:`on`, :mod:`..defaults`): 64-value packets one per message where a message is a
    datagram of a modelled network (SimFabric, the paper's), 256-value packets 1024 to a message on a
    real fabric; the switch rank and its workers resolve them alike. ``audit`` makes the switch count
    every accepted contribution by ``(job, packet, worker)`` (tests only). ``workers``: the most workers
    the program's bitmap holds (module docstring, "Past 32 workers"), a multiple of 32 up to
    :data:`WIDEST`; ``None``: the reference program's 32, or the job's workers rounded up to a multiple
    of 32 when there are more (:meth:`on`: the fabric's world size, the same on the switch rank).
    """

    NAME = "switch"

    elems: int | None = None
    slots: int = DEFAULT_SLOTS
    burst: int | None = None
    audit: bool = False
    workers: int | None = None

    def __post_init__(self) -> None:
        if self.elems is not None and self.elems not in PACKET_ELEMS:
            raise InvalidValueError(f"slot_elems must be one of {PACKET_ELEMS} (the P4 program's packet sizes), "
                             f"got {self.elems}")
        if not isinstance(self.slots, int) or self.slots < 2:
            raise InvalidValueError(f"switch slots must be an integer >= 2, got {self.slots!r}")
        if self.burst is not None and (not isinstance(self.burst, int) or self.burst < 1):
            raise InvalidValueError(f"burst must be a positive integer, got {self.burst!r}")
        if self.workers is not None and (not isinstance(self.workers, int) or isinstance(self.workers, bool)
                                         or not MAX_WORKERS <= self.workers <= WIDEST or self.workers % 32):
            raise InvalidValueError(f"switch workers (the bitmap's width) must be a multiple of 32 in "
                                    f"[{MAX_WORKERS}, {WIDEST}], got {self.workers!r}")

    @property
    def width(self) -> int:
        """The most workers the program's bitmap holds (``workers``, or the reference program's 32)."""
        return self.workers if self.workers is not None else MAX_WORKERS

    def on(self, fabric: Fabric) -> "SwitchConfig":
        """This program on ``fabric``: the constants left ``None`` take the fabric's defaults."""
        elems = self.elems if self.elems is not None else defaults.packet_elems(fabric, PACKET_ELEMS)
        burst = self.burst if self.burst is not None else defaults.packets_per_message(fabric, elems)
        workers = self.workers
        if workers is None and fabric.world_size > MAX_WORKERS:
            workers = min(WIDEST, -(-fabric.world_size // 32) * 32)
        return replace(self, elems=elems, burst=burst, workers=workers)

    def spec(self) -> str:
        """The service spec naming this program: ``"switch"`` for the defaults."""
        return services.config_spec("switch", self)

    @classmethod
    def parse(cls, arg: str | None) -> "SwitchConfig":
        """Inverse of :meth:`spec` for the part after ``switch:`` (a bare integer means ``elems``)."""
        return services.parse_config(cls, "switch", arg, bare="elems")


# ----------------------------------------------------------------------------- the program
@njit(cache=True, nogil=True)
def _program(rows, values, seen, count, exponent, world, mc, uc, new, counters, clear,
             alias):  # pragma: no cover - numba
    """Run the per-packet program (module docstring) on every row of one message, in order.

    Results go to ``mc`` (multicast) and ``uc`` (unicast to the sender), rows of the same width, filled
    from the front (header-only ``rows``, ``HEADER`` words each: their values are zero, and their results
    header-only); ``new[i]`` marks row ``i`` as a new contribution (for the audit). Returns the
    number of rows written to each. ``counters`` accumulates :data:`COUNTERS` (a row of another type
    than ``EMPTY`` or ``DATA`` is a packet, and malformed). With ``clear``, each
    row's type is reset to ``T_EMPTY`` once read (a receive buffer made ready for its next message).
    ``alias``: ``mc`` starts at ``rows``' first row (results over the rows they answer); a result written
    over the very row it answers is then written in the add's loop through that row (a loop through
    another view of it would be compiled without vector instructions: the views might overlap)."""
    slots, elems, words = values.shape[0], values.shape[2], seen.shape[2]
    short = rows.shape[1] == 8                    # header-only packets: their values are all zero
    nmc = 0
    nuc = 0
    for i in range(rows.shape[0]):
        new[i] = 0
        kind = rows[i, 0]
        if clear:
            rows[i, 0] = 0
        if kind == 0:                             # an unused row of a burst
            continue
        counters[0] += 1
        slot, v, w, n = rows[i, 1], rows[i, 2], rows[i, 3], rows[i, 6]
        if not (kind == 1 and 0 <= slot < slots and (v == 0 or v == 1) and 0 <= w < n <= 32 * words
                and (world <= 0 or n == world) and (short or rows.shape[1] == 8 + elems)):
            counters[1] += 1                      # a parser drops what it cannot match
            continue
        k = w >> 5                                # the bitmap word of worker w
        bit = np.uint32(1) << np.uint32(w & 31)
        before = seen[slot, v, k]
        empty = before == 0                       # the set holds no contribution yet: every word 0
        if empty:
            for q in range(words):
                if seen[slot, v, q] != 0:
                    empty = False
        seen[slot, v, k] = before | bit
        seen[slot, 1 - v, k] &= ~bit
        if before & bit == 0:
            e = np.int8(rows[i, 7])
            acc = values[slot, v]
            vec = rows[i, 8:]
            # the contribution that completes the slot writes the result's values as it stores them
            # (into mc[nmc], which may be this very row: each element is read before it is written)
            left = n - 1 if empty else count[slot, v] - 1
            if short:                             # values all zero: only the exponent counts
                if empty:
                    for j in range(elems):
                        acc[j] = 0
                    exponent[slot, v] = e
                elif e > exponent[slot, v]:
                    exponent[slot, v] = e
            elif empty:                           # the first writer overwrites
                if left == 0 and not (alias and nmc == i):
                    res = mc[nmc, 8:]
                    for j in range(elems):
                        b = vec[j]
                        acc[j] = b
                        res[j] = b
                else:
                    for j in range(elems):
                        acc[j] = vec[j]
                exponent[slot, v] = e
            else:
                # two's-complement wrap as the hardware's adds (the workers' scale must prevent it); a
                # sum wrapped iff both addends' signs differ from its sign: 8 int32 lanes per AVX2 add
                wrapped = np.int32(0)
                if left == 0 and alias and nmc == i:     # the result goes over this very row
                    for j in range(elems):
                        a = acc[j]
                        b = vec[j]
                        s = np.int32(np.uint32(a) + np.uint32(b))
                        wrapped |= (a ^ s) & (b ^ s)
                        acc[j] = s
                        vec[j] = s
                elif left == 0:
                    res = mc[nmc, 8:]
                    for j in range(elems):
                        a = acc[j]
                        b = vec[j]
                        s = np.int32(np.uint32(a) + np.uint32(b))
                        wrapped |= (a ^ s) & (b ^ s)
                        acc[j] = s
                        res[j] = s
                else:
                    for j in range(elems):
                        a = acc[j]
                        b = vec[j]
                        s = np.int32(np.uint32(a) + np.uint32(b))
                        wrapped |= (a ^ s) & (b ^ s)
                        acc[j] = s
                if wrapped < 0:
                    counters[6] += 1
                if e > exponent[slot, v]:
                    exponent[slot, v] = e
            count[slot, v] = left
            counters[2] += 1
            new[i] = 1
            if left == 0:                         # multicast: the header (values written above)
                for j in range(8):
                    mc[nmc, j] = rows[i, j]
                mc[nmc, 0] = 2
                mc[nmc, 7] = exponent[slot, v]
                nmc += 1
                counters[3] += 1
        elif count[slot, v] == 0:                 # duplicate after completion: the stored result
            _reply(rows, i, values, exponent, slot, v, 3, uc, nuc)
            nuc += 1
            counters[4] += 1
        else:                                     # duplicate, slot still incomplete
            counters[5] += 1
    return nmc, nuc


@njit(cache=True, nogil=True)
def _reply(rows, i, values, exponent, slot, v, kind, out, k):  # pragma: no cover - numba
    for j in range(8):
        out[k, j] = rows[i, j]
    out[k, 0] = kind
    out[k, 7] = exponent[slot, v]
    for j in range(out.shape[1] - 8):             # none for a header-only reply
        out[k, 8 + j] = values[slot, v, j]


class Dataplane:
    """The switch's registers and its per-packet program (see the module docstring)."""

    def __init__(self, config: SwitchConfig) -> None:
        if config.elems is None:
            raise InvalidValueError(f"a dataplane needs its packet size: SwitchConfig(elems=...) or "
                                    f"config.on(fabric), got {config}")
        self.config = config
        s, k = config.slots, config.elems
        self.values = np.zeros((s, 2, k), dtype=np.int32)
        words = config.width // 32
        #: the bitmap: ``(slots, 2)`` as the reference program's, ``(slots, 2, words)`` when wider
        self.seen = np.zeros((s, 2) if words == 1 else (s, 2, words), dtype=np.uint32)
        self._bitmap = self.seen.reshape(s, 2, words)       # the same registers, as the program reads them
        self.count = np.zeros((s, 2), dtype=np.int32)
        self.exponent = np.zeros((s, 2), dtype=np.int8)
        # packet counters (the P4 next_step_selector keeps the same ones per pool index)
        self.stats = Counter()
        self.audit: Counter | None = Counter() if config.audit else None
        #: the job's number of workers, known from the fabric once serving; a packet claiming another
        #: worker count (or a worker id outside it) is malformed and dropped, never multicast
        self.world: int | None = None

    @property
    def register_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: getattr(self, name).shape for name in ("values", "seen", "count", "exponent")}

    def process(self, rows: np.ndarray, burst: int | None = None):
        """Run the program on the packets of one message (an int32 array of rows); return (rows to
        multicast, rows to unicast to the sender), each of shape ``(k, HEADER + elems)``. One compiled
        call whatever the number of rows; rows of another width than a whole packet's or a header's
        (header-only packets, module docstring) are all malformed. With ``burst``, each
        is instead a list of messages of ``burst`` rows (unused rows ``T_EMPTY``), ready to send."""
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        if rows.ndim != 2:
            rows = rows.reshape(1, -1)
        k, width = rows.shape
        data = int(np.count_nonzero(rows[:, F_TYPE] == T_DATA))    # no more replies than data rows
        cap = data if burst is None else -(-data // burst) * burst
        mc = np.empty((cap, width), dtype=np.int32)
        uc = np.empty((cap, width), dtype=np.int32)
        nmc, nuc, _ = self.execute(rows, mc, uc, alias=False)
        if burst is None:
            return mc[:nmc], uc[:nuc]
        return split_messages(mc, nmc, burst), split_messages(uc, nuc, burst)

    def execute(self, rows: np.ndarray, mc: np.ndarray, uc: np.ndarray, scratch: np.ndarray | None = None,
                clear: bool = False, alias: bool | None = None):
        """:meth:`process` into the caller's reply buffers (int32, C-contiguous, as wide as ``rows`` and
        at least as many rows as ``rows`` has data rows, e.g. ``len(rows)``): the service's path, with
        reply buffers it reuses. Returns (multicast rows, unicast rows) written from the front, and how
        many rows were malformed (dropped; the service reports them, :func:`rejection`). With
        ``clear``, every row's type is reset to ``T_EMPTY`` as it is read (a receive buffer, ready to be
        posted again; the audit still sees the rows' other fields). ``mc`` may be ``rows`` itself (or the
        buffer it is the front of): result ``k`` is written over row ``k``, which the program has read by
        then (``k`` never exceeds the row it answers); the audit, which reads the rows afterwards, then
        sees results instead (the service keeps separate buffers when it is on). ``alias``: whether ``mc`` starts
        at ``rows``' first row, if the caller knows (``None``: found out here)."""
        k = rows.shape[0]
        new = scratch[:k] if scratch is not None and len(scratch) >= k else np.empty(k, dtype=np.uint8)
        counters = np.zeros(len(COUNTERS), dtype=np.int64)
        if alias is None:
            alias = bool(mc.shape[1] == rows.shape[1] and mc.__array_interface__["data"][0]
                         == rows.__array_interface__["data"][0])
        nmc, nuc = _program(rows, self.values, self._bitmap, self.count, self.exponent,
                            self.world if self.world is not None else 0, mc, uc, new, counters, clear, alias)
        for name, c in zip(COUNTERS, counters.tolist()):
            if c:
                self.stats[name] += c
        if self.audit is not None:
            for r in rows[new.astype(bool)]:
                self.audit[(int(r[F_JOB]), int(r[F_PKT]), int(r[F_WORKER]))] += 1
        return int(nmc), int(nuc), int(counters[1])


def split_messages(out: np.ndarray, used: int, burst: int, pad: bool = True) -> list[np.ndarray]:
    """The first ``used`` rows of ``out`` as messages of ``burst`` rows, the last one's unused rows
    ``T_EMPTY`` (``out`` must hold a whole number of bursts past ``used``); ``pad=False``: the last message
    as long as its rows (real fabrics, :mod:`.lanes`: messages as long as their packets)."""
    end = -(-used // burst) * burst if pad else used
    out[used:end] = 0                                     # padding rows: T_EMPTY
    return [out[i:min(i + burst, end)] for i in range(0, used, burst)]


def short_frame(buf: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A ``SHORT`` message of ``count`` header-only packets at the front of ``buf`` (an int32 message buffer,
    C-contiguous, of at least ``HEADER * (count + 1)`` words): ``(the message, flat; its header rows, a
    (count, HEADER) view to fill)``, the first row ``(SHORT, count, 0, ...)`` written."""
    flat = buf.reshape(-1)
    flat[:HEADER] = 0
    flat[F_TYPE], flat[F_SHORT_COUNT] = T_SHORT, count
    end = HEADER * (count + 1)
    return flat[:end], flat[HEADER:end].reshape(count, HEADER)


def short_rows(buf: np.ndarray, most: int) -> np.ndarray | None:
    """The header rows of the ``SHORT`` message received at the front of ``buf`` (its first row's type is
    ``SHORT``), a view; ``None`` when its count is outside ``0..most`` or past the buffer (malformed)."""
    flat = buf.reshape(-1)
    count = int(flat[F_SHORT_COUNT])
    if not 0 <= count <= min(most, flat.size // HEADER - 1):
        return None
    return flat[HEADER:HEADER * (count + 1)].reshape(count, HEADER)


def short_extent(count: int, width: int) -> int:
    """How many ``width``-word rows of a message buffer a ``SHORT`` message of ``count`` packets covers (the
    rows whose type word it overwrote)."""
    return -(-HEADER * (count + 1) // width)


def rejection(width: int, burst: int, worker: int, world: int, count: int) -> np.ndarray:
    """The message (``burst`` rows of ``width`` words) telling every worker that the switch dropped
    ``count`` malformed packets that came on ``worker``'s port: row 0 of type ``REJECT`` with
    ``F_REJECTED = worker``, ``F_NW = world`` and ``F_REJECTED_COUNT = count``; the others ``T_EMPTY``."""
    msg = np.zeros((burst, width), dtype=np.int32)
    msg[0, F_TYPE], msg[0, F_REJECTED], msg[0, F_NW], msg[0, F_REJECTED_COUNT] = T_REJECT, worker, world, count
    return msg
