"""The switch endpoint of SwitchML-style in-network aggregation (Sapio et al., NSDI'21, arXiv 1903.06701).

A dataplane program holding only what a programmable switch can hold, following the public
implementation p4lang/p4app-switchML (``dev_root/p4/bitmap_checker.p4``, ``workers_counter.p4``,
``processor.p4``, ``exponents.p4``, ``controller/next_step_selector.py``): fixed register arrays of
``slots`` slots, each with **two sets** (the P4 pool index carries the set bit), every set holding

- ``values[slot, set, :]``: ``slot_elems`` int32 accumulators (64 per pass, 256 with recirculation);
- ``seen[slot, set]``: a 32-bit worker bitmap (hence at most 32 workers per job);
- ``count[slot, set]``: contributions still missing;
- ``exponent[slot, set]``: the int8 maximum of the workers' exponents (quantisation, see ``switch.py``).

Per packet ``(slot, set v, worker w, n, exponent e, vector)``, as the P4 program does::

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
a job abandoned half-way can never leave a stale count behind.

Per-packet work is vectorised over the packet's vector (numpy); the only Python loop is over the
packets of one fabric message ("burst"). Nothing grows with the number of packets except the optional
``audit`` counter, which is test instrumentation, not switch state.

Malformed input never reaches a register or a multicast: a packet whose slot, set, worker id or worker
count (it must equal the job's, which the switch knows from its fabric) is out of range is counted in
``stats["malformed"]`` and dropped, as a P4 parser drops what it cannot match; one forged packet
claiming 32 workers cannot make the switch send to ranks that do not exist. (A message longer than the
burst the switch posted is beyond reach: gloo aborts the receiving process on a message longer than
its receive, and torch.distributed offers no receive of unknown size. On real fabrics the switch posts
a zeroed receive of ``RECV_SLACK`` bursts, so a message of up to 4x the burst is processed packet by
packet; only a longer one, which no worker of this library sends, would abort it.)

Wire format: one int32 row per packet, ``HEADER`` fields then ``slot_elems`` values; a fabric message
carries ``burst`` rows (unused rows have type ``T_EMPTY``), workers -> switch on ``TAG_UP``, switch ->
workers on ``TAG_DOWN``, all ``reliable=False``.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
import torch

from ..fabric import services
from ..fabric.base import Fabric

# ----------------------------------------------------------------------------- wire format
F_TYPE, F_SLOT, F_SET, F_WORKER, F_PKT, F_JOB, F_NW, F_EXP = range(8)
HEADER = 8
T_EMPTY, T_DATA, T_RESULT, T_RETRANSMIT = 0, 1, 2, 3
TAG_UP = 0x5A51
TAG_DOWN = 0x5A52

MAX_WORKERS = 32                   # 32-bit worker bitmap (p4/configuration.p4: max_num_workers)
PACKET_ELEMS = (64, 256)           # the P4 program accepts 64 (one pass) or 256 (recirculation)
DEFAULT_SLOTS = 8192               # 16384 register entries = 8192 slot pairs (configuration.p4)
EXP_MIN, EXP_MAX = -128, 127       # int8 exponent registers (exponents.p4)
SIM_BURST, REAL_BURST = 1, 32      # packets per fabric message: one datagram in the sim; amortised on real fabrics
RECV_SLACK = 4                     # real fabrics: the switch's receive holds this many bursts (see serve)


@dataclass(frozen=True)
class SwitchConfig:
    """Compile-time constants of the switch program; they name the service (``"switch:elems=256"``).

    ``burst=None`` means one packet per message on SimFabric and ``REAL_BURST`` elsewhere (workers
    and switch apply the same rule). ``audit`` makes the switch count every accepted contribution by
    ``(job, packet, worker)`` (tests only).
    """

    elems: int = 64
    slots: int = DEFAULT_SLOTS
    burst: int | None = None
    audit: bool = False

    def __post_init__(self) -> None:
        if self.elems not in PACKET_ELEMS:
            raise ValueError(f"slot_elems must be one of {PACKET_ELEMS} (the P4 program's packet sizes), "
                             f"got {self.elems}")
        if not isinstance(self.slots, int) or self.slots < 2:
            raise ValueError(f"switch slots must be an integer >= 2, got {self.slots!r}")
        if self.burst is not None and (not isinstance(self.burst, int) or self.burst < 1):
            raise ValueError(f"burst must be a positive integer, got {self.burst!r}")

    def spec(self) -> str:
        """The service spec naming this program: ``"switch"`` for the defaults."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={int(v) if isinstance(v, bool) else v}")
        return "switch" + (":" + ",".join(parts) if parts else "")

    @classmethod
    def parse(cls, arg: str | None) -> "SwitchConfig":
        """Inverse of :meth:`spec` for the part after ``switch:`` (a bare integer means ``elems``)."""
        if not arg:
            return cls()
        kw: dict = {}
        for item in arg.split(","):
            key, eq, val = item.partition("=")
            if not eq:
                key, val = "elems", key
            if key not in {f.name for f in fields(cls)}:
                raise ValueError(f"unknown switch option {key!r} in {arg!r}; valid: elems, slots, burst, audit")
            kw[key] = bool(int(val)) if key == "audit" else int(val)
        return cls(**kw)

    def burst_for(self, fabric: Fabric) -> int:
        if self.burst is not None:
            return self.burst
        return SIM_BURST if fabric.modelled_time else REAL_BURST


class Dataplane:
    """The switch's registers and its per-packet program (see the module docstring)."""

    def __init__(self, config: SwitchConfig = SwitchConfig()) -> None:
        self.config = config
        s, k = config.slots, config.elems
        self.values = np.zeros((s, 2, k), dtype=np.int32)
        self.seen = np.zeros((s, 2), dtype=np.uint32)
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

    def process(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the program on the packets of one message; return (rows to multicast, rows to unicast),
        each an int32 array of shape ``(k, HEADER + elems)``.

        A burst from one worker whose packets address distinct slots -- what workers send -- is
        processed in one vectorised pass; anything else packet by packet (same result: the packets of
        such a burst touch disjoint registers; a packet touches both sets of its slot).
        """
        data = rows[rows[:, F_TYPE] == T_DATA]
        if len(data) > 1:
            fast = self._process_burst(data)
            if fast is not None:
                return fast
        mc, uc = self._process_rows(data)
        width = rows.shape[1]
        return (np.stack(mc) if mc else np.zeros((0, width), np.int32),
                np.stack(uc) if uc else np.zeros((0, width), np.int32))

    def _process_burst(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        cfg = self.config
        slot, v, w, n = (rows[:, F_SLOT].astype(np.int64), rows[:, F_SET].astype(np.int64),
                         rows[:, F_WORKER].astype(np.int64), rows[:, F_NW].astype(np.int64))
        if (rows.shape[1] != HEADER + cfg.elems or (w != w[0]).any() or (n != n[0]).any()
                or not (0 <= w[0] < n[0] <= MAX_WORKERS) or (self.world is not None and n[0] != self.world)
                or (slot < 0).any() or (slot >= cfg.slots).any()
                or ((v != 0) & (v != 1)).any() or len(np.unique(slot)) != len(rows)):
            return None
        k = len(rows)
        self.stats["packets"] += k
        bit = np.uint32(1 << int(w[0]))
        before = self.seen[slot, v]
        self.seen[slot, v] = before | bit
        self.seen[slot, 1 - v] &= ~bit
        new = (before & bit) == 0
        first = new & (before == 0)
        add = new & ~first
        vec, e = rows[:, HEADER:], rows[:, F_EXP].astype(np.int8)
        if first.any():
            sf, vf = slot[first], v[first]
            self.values[sf, vf] = vec[first]
            self.exponent[sf, vf] = e[first]
            self.count[sf, vf] = n[0] - 1
        if add.any():
            sa, va = slot[add], v[add]
            acc = self.values[sa, va]
            va_add = vec[add]
            wide = acc.astype(np.int64)
            wide += va_add
            if wide.max() > 2**31 - 1 or wide.min() < -(2**31):
                self.stats["overflow"] += 1
            self.values[sa, va] = acc + va_add
            self.exponent[sa, va] = np.maximum(self.exponent[sa, va], e[add])
            self.count[sa, va] -= 1
        self.stats["consumed"] += int(new.sum())
        if self.audit is not None:
            for r in rows[new]:
                self.audit[(int(r[F_JOB]), int(r[F_PKT]), int(w[0]))] += 1
        done = self.count[slot, v] == 0
        mc, uc = new & done, ~new & done
        self.stats["multicast"] += int(mc.sum())
        self.stats["retransmit"] += int(uc.sum())
        self.stats["dropped"] += int((~new & ~done).sum())
        return self._replies(rows[mc], slot[mc], v[mc], T_RESULT), self._replies(rows[uc], slot[uc], v[uc], T_RETRANSMIT)

    def _replies(self, rows: np.ndarray, slot: np.ndarray, v: np.ndarray, kind: int) -> np.ndarray:
        out = rows.copy()
        if len(out):
            out[:, F_TYPE] = kind
            out[:, F_EXP] = self.exponent[slot, v]
            out[:, HEADER:] = self.values[slot, v]
        return out

    def _process_rows(self, rows: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        mcast: list[np.ndarray] = []
        ucast: list[np.ndarray] = []
        k = self.config.elems
        for row in rows:
            if row[F_TYPE] != T_DATA:
                continue
            self.stats["packets"] += 1
            slot, v, w, n = int(row[F_SLOT]), int(row[F_SET]), int(row[F_WORKER]), int(row[F_NW])
            if not (0 <= slot < self.config.slots and v in (0, 1) and 0 <= w < n <= MAX_WORKERS
                    and (self.world is None or n == self.world) and row.shape[0] == HEADER + k):
                self.stats["malformed"] += 1       # a real parser drops what it cannot match
                continue
            bit = np.uint32(1 << w)
            before = self.seen[slot, v]
            self.seen[slot, v] = before | bit
            self.seen[slot, 1 - v] &= ~bit
            if not before & bit:
                vec = row[HEADER:]
                e = np.int8(row[F_EXP])
                if before == 0:
                    self.values[slot, v] = vec
                    self.exponent[slot, v] = e
                    self.count[slot, v] = n - 1
                else:
                    acc = self.values[slot, v]
                    wide = acc.astype(np.int64) + vec
                    if np.abs(wide).max() > 2**31 - 1:
                        self.stats["overflow"] += 1    # hardware wraps; the workers' scale must prevent it
                    acc += vec
                    if e > self.exponent[slot, v]:
                        self.exponent[slot, v] = e
                    self.count[slot, v] -= 1
                self.stats["consumed"] += 1
                if self.audit is not None:
                    self.audit[(int(row[F_JOB]), int(row[F_PKT]), w)] += 1
                if self.count[slot, v] == 0:
                    mcast.append(self._reply(row, slot, v, T_RESULT))
                    self.stats["multicast"] += 1
            elif self.count[slot, v] == 0:
                ucast.append(self._reply(row, slot, v, T_RETRANSMIT))
                self.stats["retransmit"] += 1
            else:
                self.stats["dropped"] += 1
        return mcast, ucast

    def _reply(self, row: np.ndarray, slot: int, v: int, kind: int) -> np.ndarray:
        out = row.copy()
        out[F_TYPE] = kind
        out[F_EXP] = self.exponent[slot, v]
        out[HEADER:] = self.values[slot, v]
        return out

    # ------------------------------------------------------------------ service loop
    def serve(self, fabric: Fabric) -> None:
        """The switch's main loop: receive a message, run the program, multicast / unicast replies.

        Replies use ``isend`` and are never waited for on SimFabric (ports transmit in parallel);
        on real fabrics the pending sends are reaped as they complete. Returns (or lets the fabric's
        shutdown exception propagate) when the run ends.
        """
        burst = self.config.burst_for(fabric)
        width = HEADER + self.config.elems
        self.world = fabric.world_size
        track = not fabric.modelled_time
        # on real fabrics the receive has room for RECV_SLACK bursts and is zeroed first (gloo accepts a
        # shorter message, leaving the rest untouched; unused rows read as T_EMPTY): a message of up to
        # RECV_SLACK bursts is processed packet by packet instead of aborting the switch's process
        rows = burst * (RECV_SLACK if track else 1)
        buf = torch.zeros((rows, width), dtype=torch.int32)
        arr = buf.numpy()
        pending: deque = deque()
        while True:
            if track:
                buf.zero_()
            src = fabric.recv(buf, None, TAG_UP)
            if not 0 <= src < self.world:        # only workers talk to the switch
                self.stats["malformed"] += 1
                continue
            mcast, ucast = self.process(arr)
            for i in range(0, len(mcast), burst):     # replies in messages of one burst each
                msg = _pack(mcast[i:i + burst], burst, width)
                for dst in range(self.world):
                    w = fabric.isend(msg, dst, TAG_DOWN, reliable=False)
                    if track:
                        pending.append((w, msg))
            for i in range(0, len(ucast), burst):
                msg = _pack(ucast[i:i + burst], burst, width)
                w = fabric.isend(msg, src, TAG_DOWN, reliable=False)
                if track:
                    pending.append((w, msg))
            while pending and (len(pending) > 4 * MAX_WORKERS or pending[0][0].is_completed()):
                pending.popleft()[0].wait()


def _pack(rows: np.ndarray, burst: int, width: int) -> torch.Tensor:
    out = np.zeros((burst, width), dtype=np.int32)
    out[: len(rows)] = rows
    return torch.from_numpy(out)


def service_main(config: SwitchConfig) -> Callable[[Fabric], None]:
    """A fresh dataplane's service loop, for a launcher-started switch rank."""
    return Dataplane(config).serve


@services.registry.register("switch")
def _switch_service(arg: str | None) -> Callable[[Fabric], None]:
    return service_main(SwitchConfig.parse(arg))
