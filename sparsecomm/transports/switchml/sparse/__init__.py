"""``sparse-switch``: OmniReduce's look-ahead inside a SwitchML switch's limits.

SwitchML (Sapio et al., NSDI'21) sums dense fixed-point streams in a bounded pool of switch slots;
OmniReduce (Fei et al., SIGCOMM'21) sends only non-zero blocks, each with the offset of the sender's
next non-zero block in its lane, to CPU aggregators. This transport runs the second on the first:
workers send only their non-zero blocks, the switch adds them in a pool of fixed-size slots with
integer arithmetic, and a block that is zero on every worker never travels, up or down.

Protocol, per job (every worker, in this order; :class:`SparseSwitch` reads top to bottom)
-----------------------------------------------------------------------------------------
The tensor is cut into blocks of ``k`` elements (``k`` = the switch's packet, 64 or 256 int32), block
``b`` in lane ``j = b mod L`` at position ``p = b div L`` (``L = min(pool_size, blocks)`` lanes, one
switch slot each).

0. **Agreement** (among the workers, not through the switch): the fixed-size header every transport
   exchanges first (:func:`..._handshake.check_agreement`: the transport's name, the switch rank and the
   program's constants), so that a worker running another transport gets a ``MismatchError`` naming
   both, on every rank, instead of a wait for packets that never come.
1. **Control** (slot 0, one packet per worker, summed): validity flags and the values workers must
   agree on (length, dtype, pool size, packet size), encoded so that the integer sum reveals a
   disagreement (``n sum b^2 == (sum b)^2`` per byte ``b``, as ``switch``). Every worker receives the
   same sum and raises the same error before any data moves.
2. **Look-ahead** (a MIN round): every worker sends the vector ``[-e, first_0, ..., first_{L-1}]``
   (``e``: the exponent of its largest magnitude, ``2^e > max|x|``; ``first_j``: its first non-zero
   position in lane ``j``, ``NONE`` if none) in ``ceil((L+1)/k)`` packets; the switch keeps the
   element-wise minimum. Every worker learns the agreed exponent ``E = max e`` -- hence the scale
   ``f = (INT32_MAX/n - 1) / 2^E`` (:func:`sparsecomm.codec.scale_from_exponents`), agreed before the
   stream -- and each lane's first union position; a lane whose minimum is ``NONE`` never runs.
3. **Stream** (self-clocked, one outstanding packet per lane): for the lane's current position ``q``
   a worker that holds block ``q`` sends its codes ``round(x f)`` with its next non-zero position in
   the lane (the look-ahead); a worker that does not hold it sends a 16-byte *skip* carrying its
   pending look-ahead. The slot adds the codes, keeps the minimum announced next position, and once
   all ``n`` have reported it multicasts the sum with that minimum, which is the lane's next
   position: exactly the union's blocks travel down, and only holders' blocks up.

Design decisions the switch forces (the P4 programmer's view)
-------------------------------------------------------------
*How does a slot learn who will contribute?* OmniReduce's aggregator keeps every worker's latest
look-ahead per lane and takes their minimum. A switch cannot: a register array is read at one index
per packet pass, so a minimum over ``n`` stored offsets needs ``n`` register arrays (``n/4`` stages
of SwitchML's 4 register ALUs per stage, per pass) or ``n`` recirculations, per block. And a
non-holder that never sends cannot be covered by loss recovery: if the result of a round it did not
contribute to is lost on its way to it, the slot may already be reused when it notices (the next
round needs only the holders). Here every worker reports every round -- holders with their block,
the others with a skip header -- so the switch needs no per-worker state beyond SwitchML's seen
bitmap, the minimum is taken over the round's ``n`` packets (one register, ``min`` on the fly), the
completion rule is SwitchML's counter, and loss recovery is SwitchML's unchanged (every worker holds
a timer for every round, a retransmission is absorbed by the bitmap, a duplicate after completion
gets the stored result). The price is ``h = 16`` bytes per worker per union block upstream, against
the ``h + 4k`` bytes of that block every worker receives anyway: at ``k = 256`` a worker's bytes are
at most ``(2h + 4k) / (4k + 4) = 1.027`` times OmniReduce's ideal (own blocks up, union down, 4 bytes
of look-ahead each), whatever the densities.

*The union denser than the pool.* The pool bounds lanes, not data: a lane with ``R_j`` union blocks
runs ``R_j`` rounds back to back, one round trip each. The stream moves in *waves* (wave ``r``: the
``r``-th union block of every lane that has one), each a round trip long unless its packets take
longer to serialise; with ``L`` slots of ``4k`` bytes it reaches line rate only if ``L * 4k`` covers
the bandwidth-delay product (SwitchML's rule). Below that, time grows with the number of waves, i.e.
with the union's blocks per lane (pool pressure): at density 1 this is SwitchML's stream (plus the
look-ahead round, minus its exponent batch), at density ``d`` it has ``d`` times the waves.
Nothing needs more switch memory when the union is dense; it takes more round trips.

*Small tensors.* The control and look-ahead rounds are two round trips before the first block (the
dense ``switch`` needs the control round and a one-round exponent batch); the closed form
:func:`theory.costs.sparse_switch_allreduce` includes them. They could share one round (a control
packet whose last value register takes the MIN action), but the number of look-ahead packets
depends on the tensor's length and the pool, which the control round is there to check: workers that
disagree would leave half-filled slots behind and wait for results that never come. Kept apart,
a disagreement is an error on every worker before anything else is sent.

*Scale.* One exponent per job (not per packet as SwitchML's) because the scale must be agreed before
the stream and every worker sends in a different subset of the rounds: elements far below the
tensor's maximum keep ``31 - log2 n - (E - e_elem)`` bits. Error per element ``<= n * 0.5 / f``. As on
``switch``, a magnitude ``>= 2^max_exponent`` (default 2^64) is :class:`~sparsecomm.errors.OverflowError_`
on every worker (the control round's too-large flag): past it the quantum ``n 2^(E-31)`` exceeds
``2^33 n`` and every ordinary value of the job would silently become 0 (one 1e30 would zero values of
1e-3 everywhere in the tensor). Half-precision inputs are summed in float32; a sum beyond their dtype's range is
``OverflowError_`` on every worker, never ``inf`` (:func:`..control.narrowed`).

Match-action pipeline (one pass per 64 values; 256 values with SwitchML's recirculation)
----------------------------------------------------------------------------------------
Budget: 12 match-action stages per pipe on Tofino 1 (20 on Tofino 2), 4 register ALUs per stage, a
register ALU updating one 32-bit value or a pair (SwitchML's 64 values use 8 stages of 4 pairs).
=====  =================================================================  ========================
stage  action                                                             registers (per slot, 2 sets)
=====  =================================================================  ========================
0      parse ``W0, slot, pos, next``; table: job -> n, worker bit; set    --
1      ``seen`` RMW on the worker's 64-bit word ``u = w div 64``:        seen 2 x B b (B/64 words
       ``before = seen[v][u]; seen[v][u] |= bit``; ``seen[1-v][u]``     of 64 b; B = 64 up to
       cleared (two 32-bit halves as a pair: one register ALU)          64 workers)
2      ``count`` RMW (if new: n-1 if ``count == 0``, the round's first  count 2 x (log2 B + 1) b,
       packet, else -1); ``pos`` RMW (write if first, else compare:     pos 2 x 32 b
       out-of-step packets dropped)
3      ``nxt`` RMW: first writer stores ``next``, others ``min``;       nxt 2 x 32 b, held 2 x 1 b
       ``held`` OR
4-11   ``values``: SwitchML's 64 int32 adders (4 register ALUs x 2      values 2 x 64 x 32 b
       values per stage = 8 per stage); MIN rounds use a second
       RegisterAction on the same arrays (``min`` instead of ``+``)
egress if ``count == 0``: multicast group of the job (result) / unicast
       to the sender (duplicate after completion), else drop
=====  =================================================================  ========================

Against SwitchML this adds three registers per set (``pos``, ``nxt``: 32 bits; ``held``: 1 bit),
removes the int8 exponent, and widens the worker bitmap (SwitchML: 32 workers per job) to ``B`` bits:
64 up to 64 workers, beyond the job's count rounded up to a multiple of 64, up to 1024 (the program's
``workers``, a compile-time width: :class:`.dataplane.SparseSwitchConfig`). A packet reads and writes only
its worker's 64-bit word, and a round's first packet is known by ``count == 0`` rather than an empty bitmap,
so a wider bitmap costs memory, not stages or register ALUs; the header carries the high bits of the worker
id and count in the slot word (zero up to 64 workers: the packets are those of the 64-bit program).
Memory with the defaults (``S = 1024`` slots, ``k = 256``): ``values`` ``1024 * 2 * 256 * 4 B =
2 MiB``; the rest ``1024 * 2 * (64+7+32+32+1)`` bits ``= 34 KiB`` (``B = 64``; at 1024 workers
``1024 * 2 * (1024+11+32+32+1)`` bits ``= 275 KiB``).
:func:`.dataplane.registers` declares these widths and
:meth:`~.dataplane.Dataplane.state_bits` checks the emulation against them
(``tests/transports/switchml/sparse/test_sparse_switch.py``).

Deployment: as ``switch``. On SimFabric the transport starts the program as a per-port service on
first use (its link set by ``bandwidth_gbps``/``latency_us``); on torch.distributed it is the rank the
launcher started (``services=["sparse-switch"]``) and its constants (``slot_elems``,
``switch_slots``, ``burst``) default to that rank's. There up to ``burst`` packets share a fabric
message (as many as are ready, not padded, as ``switch``'s) and skips travel padded to a value packet,
since a message costs far more than its bytes; the byte figures above are the SimFabric's,
one packet per datagram. The rounds themselves (lanes, timers, bursts) are :mod:`.rounds`.

Defaults, fast where they run (:mod:`...defaults`, from the fabric's ``message_bytes``): on SimFabric one
packet per message and a pool of 256 lanes (the settings of the closed form's comparisons); on a real
fabric a switch started as ``"sparse-switch"`` packs up to 1024 packets into a message (1 MiB) and a worker
keeps every slot but the control slot in flight (1023 lanes of the default 1024 slots).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .... import codec
from ....errors import IncompatibleError, InvalidValueError, ProtocolError, SparseCommError
from ....fabric.base import Fabric
from ..._guards import check_dtype
from ..._handshake import check_agreement
from ....theory import costs
from ...base import CallShape, Transport, registry
from ...linear import LinearOperand
from ... import defaults
from ..control import (DTYPES, DEFAULT_MAX_EXPONENT, MODE_FLOAT, MODE_INT, check_control, control_vector,
                             max_exponent_option, narrowed, started_program, too_large_text)
from .dataplane import (F_NEXT, HEADER, MAX_WORKERS, NONE, T_DATA, T_MIN, T_SKIP, JOB_MASK,
                                      Dataplane, SparseSwitchConfig, service_main)
from .rounds import Rounds, to_pos
from .stream import DATA, SKIPS, LaneStream
from ..lanes import SlotState, Timer, abandoning

INT32_MAX = 2**31 - 1
EXP_FLOOR, EXP_CEIL = -126, 127
CONTROL_SLOT = 0
# the control vector's layout, modes and dtype codes are the switch's (..control.control_vector)
_AGREE = ("numel (low word)", "numel (high word)", "mode / dtype", "pool_size", "slot_elems",
          "shared indices or scale (fingerprint)")


@dataclass
class FixedResult:
    """The integer side of the last float job: the switch's int32 sums and the agreed scale."""

    sums: torch.Tensor     # int32, numel elements
    exponent: int
    scale: float


_lock = threading.Lock()


@registry.register("sparse-switch")
class SparseSwitch(Transport):
    """Block-sparse in-network aggregation (module docstring).

    ``pool_size``: lanes (switch slots) a job keeps in flight, ``<= switch_slots - 1`` (slot 0 is the
    control slot; default 256 on SimFabric, elsewhere ``min(switch_slots - 1, 4 * burst)``, module
    docstring). ``slot_elems`` (64 or 256, default 256: a block is one packet) and ``switch_slots``
    (default 1024) are the program's constants and name its service; on real fabrics they default to
    the started switch's. ``timeout``: retransmission timer (modelled seconds on SimFabric, default
    1 ms; wall seconds elsewhere, default ``None``: no timer, gloo never drops; ``None`` too on a
    SimFabric that takes a real fabric's defaults, a host model with a cost per message, whose round
    trips can outlast 1 ms: pass one there for a lossy network); it doubles after
    ``timeout_threshold`` expiries. ``give_up_s`` (default: the fabric's ``timeout_s``): a packet
    unanswered that long raises :class:`FabricTimeout`. ``bandwidth_gbps``/``latency_us``: the switch's
    link on SimFabric. ``burst``: packets per fabric message (default 1 on SimFabric, 1024 elsewhere;
    a program constant). ``audit``: the switch counts every accepted contribution (tests only).
    ``max_exponent`` (default 64, as ``switch``'s): a magnitude ``>= 2^max_exponent`` on any worker is
    :class:`OverflowError_` on every worker (module docstring, "Scale").
    """

    name = "sparse-switch"
    sums_nonfinite = False
    carries = frozenset({"dense", "aligned", "sparse", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"aligned", "quantized"})
    #: every lane has one round outstanding: the workers send a wave, the switch adds it once every worker's
    #: packets are in, the workers take its results and send the next; the switch and the workers never
    #: compute at the same moments
    services_share_cores = False

    def __init__(self, fabric: Fabric, *, pool_size: int | None = None, slot_elems: int | None = None,
                 switch_slots: int | None = None, timeout: float | None = None, timeout_threshold: int = 100,
                 give_up_s: float | None = None, bandwidth_gbps: float | None = None,
                 latency_us: float | None = None, burst: int | None = None, audit: bool = False,
                 max_exponent: int = DEFAULT_MAX_EXPONENT) -> None:
        super().__init__(fabric)
        if not fabric.is_worker:
            raise IncompatibleError("the sparse-switch transport runs on workers, not on a service endpoint")
        n = fabric.world_size
        if n > MAX_WORKERS:
            raise IncompatibleError(
                f"transport 'sparse-switch' supports at most {MAX_WORKERS} workers (the widest worker bitmap of "
                f"its switch program); this job has {n}; use 'omnireduce' or 'ring'")
        self.sim = fabric.modelled_time
        self.config, spec = started_program(fabric, SparseSwitchConfig, slot_elems, switch_slots, burst, audit)
        if n > self.config.width:
            raise IncompatibleError(
                f"transport 'sparse-switch': the switch program {spec!r} was started for at most "
                f"{self.config.width} workers (its worker bitmap); this job has {n}; start it with "
                f"workers={-(-n // 64) * 64} or without workers (the job's count)")
        if pool_size is None:
            pool_size = defaults.pool_size(fabric, self.config.burst, self.config.slots)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or not 1 <= pool_size < self.config.slots:
            raise InvalidValueError(f"pool_size must be an integer in [1, switch_slots - 1 = {self.config.slots - 1}] "
                             f"(slot 0 is the control slot), got {pool_size!r}")
        if timeout is None and self.sim and fabric.message_bytes is None:    # the papers' defaults (..defaults)
            timeout = 1e-3
        if timeout is not None and not timeout > 0:
            raise InvalidValueError(f"timeout must be positive (or None: no timer), got {timeout!r}")
        self.max_exponent = max_exponent_option(max_exponent, EXP_FLOOR, EXP_CEIL)
        self.pool_size, self.k = pool_size, self.config.elems
        self.block_grid = self.k
        self.burst = self.config.burst
        self.timeout, self.timeout_threshold = timeout, int(timeout_threshold)
        self.give_up_s = float(give_up_s if give_up_s is not None else fabric.timeout_s)
        self.dataplane: Dataplane | None = None
        if fabric.in_process_services:
            with _lock:
                self.dataplane = fabric.world_scratch.setdefault("sparse-switch/dataplanes", {}).setdefault(spec, Dataplane(self.config))
            main = self.dataplane.serve_process if fabric.modelled_time else self.dataplane.serve
        else:
            main = service_main(self.config)
        link = {k: v for k, v in (("bandwidth_gbps", bandwidth_gbps), ("latency_us", latency_us)) if v is not None}
        self.switch = fabric.service(spec, main, per_port=True, **link)
        with _lock:
            #: the program's slots, kept across jobs and shared by this fabric's transports talking to it
            self.slots = fabric.scratch.setdefault("sparse-switch/worker_states", {}).setdefault(
                spec, SlotState(parity=np.zeros(self.config.slots, dtype=np.int64)))
        self.rounds = Rounds(fabric, self.switch, self.slots, self.k, self.burst,
                             Timer(self.timeout, self.timeout_threshold, self.timeout_threshold, self.give_up_s))
        self.last_fixed: FixedResult | None = None

    @property
    def last_info(self) -> dict:
        """The last job's per-phase packet counts (:attr:`.rounds.Rounds.info`)."""
        return self.rounds.info

    # ================================================================== payload kinds
    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        """``aligned``: the value vector (the indices' checksum in the control round), scattered after;
        ``quantized`` with a shared scale: the integer codes, exactly. ``dense`` and ``sparse`` payloads
        (worker-specific indices) are summed as the tensor they stand for (densified): only its
        non-zero blocks travel."""
        return self._job(op.vector, fingerprint=op.check, out_dtype=torch.int64 if op.codes else None)

    # ================================================================== one job, top to bottom
    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.sparse_switch_allreduce` of the call's block densities, with this
        transport's block (slot) size and pool."""
        return costs.sparse_switch_allreduce(self.fabric.world_size, call.numel, density=call.density,
                                             union_density=call.union_density, slot_elems=self.k,
                                             pool_size=self.pool_size, bandwidth_gbps=bandwidth_gbps,
                                             latency_us=latency_us)

    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        return self._job(flat)

    def _job(self, flat: torch.Tensor, *, fingerprint: int = 0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Sum ``flat`` (float: fixed point; integer: exactly) over workers; see the module docstring."""
        out_dtype, device = out_dtype or flat.dtype, flat.device
        if flat.is_floating_point():
            mode = MODE_FLOAT
        else:
            check_dtype(flat.dtype, "sparse-switch", tuple(DTYPES))   # float or one of the switch's integers
            mode = MODE_INT
        x = flat.detach().reshape(-1).to("cpu")
        N, k, n = x.numel(), self.k, self.fabric.world_size
        # ---- local facts: validity, magnitude, non-zero blocks
        if mode == MODE_FLOAT:
            x = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
            # validity, magnitude and non-zero blocks in one read of x (codec.block_facts)
            finite, e, mask = codec.block_facts(x, self.k)
            e = max(EXP_FLOOR, e)
            self._control(mode, N, flat.dtype, nonfinite=not finite, too_large=e > self.max_exponent, cap=0,
                          fingerprint=fingerprint)
        else:
            mask = None
            v = x.to(torch.int64)
            amax = int(v.abs().max()) if N else 0
            limit = min(INT32_MAX, torch.iinfo(out_dtype).max)
            self._control(mode, N, flat.dtype, nonfinite=False, too_large=amax > INT32_MAX,
                          cap=min(amax, INT32_MAX), limit=limit, fingerprint=fingerprint)
            e = 0
        # after the control round every worker is committed to the look-ahead round and the stream: an
        # error here would leave the others waiting for this worker's packets (..lanes.abandoning)
        f = self.fabric
        with abandoning(f):
            nb = -(-N // k)
            if nb == 0:
                self.last_fixed = None
                return torch.zeros(0, dtype=out_dtype, device=device)
            if mask is None:
                mask = codec.nonzero_blocks(x, k)
            f.host_work("scan", N)                  # (the block scan reads the whole tensor)
            own = np.flatnonzero(mask.numpy())      # this worker's non-zero blocks: the only ones it encodes
            L = min(self.pool_size, nb)
            la = codec.next_nonzero(mask, L)
            lanes = np.arange(L, dtype=np.int64)
            first = to_pos(la.first.numpy(), lanes, L, nb)
            # ---- look-ahead round: agreed exponent and every lane's first union position
            agreed = self._lookahead(np.concatenate([[-e], first]), L)
            E = -int(agreed[0])
            start = agreed[1:]
            if mode == MODE_FLOAT:
                if not max(EXP_FLOOR, e) <= E <= EXP_CEIL:
                    raise ProtocolError(f"sparse-switch: the look-ahead round agreed on exponent {E}, outside "
                                        f"[{max(EXP_FLOOR, e)}, {EXP_CEIL}] (this worker's own is {e}; forged or "
                                        f"corrupted packet)")
                scale = float(codec.scale_from_exponents(torch.tensor([E]), n)[0])
                # the codes of this worker's own blocks are all that is encoded (the same codes: the rounding
                # is per element), so a worker holds O(its non-zero blocks), not O(numel); the host model charges
                # that copy and its codes (sim_host)
                f.host_work("copy", len(own) * k * x.element_size())
                f.host_work("fresh", len(own) * k * x.element_size())
                xo = own_blocks(x, own, k)
                try:
                    codes = codec.to_fixed(xo, scale).numpy().reshape(-1, k)
                except SparseCommError:     # (raised again on the whole tensor: the error names its element)
                    xp = torch.zeros(nb * k, dtype=x.dtype)
                    xp[:N] = x
                    codec.to_fixed(xp, scale)
                    raise
                del xo
            else:
                codes = own_blocks(x, own, k).to(torch.int32).numpy().reshape(-1, k)
            f.host_work("fresh", len(own) * k * 4)         # (the codes, allocated per call: sim_host)
            # ---- stream: only the union's blocks, one round each
            blocks, got = self._stream(codes, own, la.next.numpy(), first, start, L, nb)
            # the host work of the results' rows (sim_host): a row copied per block (as each result arrives, out
            # of the receive buffer; charged here, after the last); each scatter below writes the union's blocks
            # at their rows (a block index and its bytes)
            f.host_work("index", len(blocks))
            f.host_work("move", len(blocks) * (HEADER + k) * 4)
            sums = np.zeros(N, dtype=np.int32)     # (zero pages until written: the union's blocks are)
            scatter_blocks(blocks, got, sums, k)
            f.host_work("index", len(blocks))
            f.host_work("move", len(blocks) * k * 4)
            f.host_work("fresh", len(blocks) * k * 4)
            q = torch.from_numpy(sums)
            if mode == MODE_INT:
                self.last_fixed = None
                return q.to(device=device, dtype=out_dtype)
            self.last_fixed = FixedResult(q, E, scale)
            # the union's blocks decoded into their places (codec.from_fixed_blocks: from_fixed's values, in one
            # pass with no float64 copies), every other element 0.0 as from_fixed gives for a zero sum
            total = torch.zeros(N, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
            codec.from_fixed_blocks(torch.from_numpy(got), torch.as_tensor(blocks, dtype=torch.int64), scale, total)
            # (sim_host: the result zeroed, a pass over every element; the union's sums decoded, charged as
            # from_fixed's three passes -- cast to float64, divided by the scale, cast to the result's dtype -- and
            # scattered, which the compiled decode does in one)
            f.host_work("elementwise", N + 3 * len(blocks) * k)
            f.host_work("index", len(blocks))
            f.host_work("move", len(blocks) * k * total.element_size())
            f.host_work("fresh", total.nbytes)
        return narrowed(total, out_dtype, "sparse-switch").to(device)     # the same sum, so the same error, everywhere

    # ================================================================== phase 1: control
    def _control(self, mode: int, numel: int, dtype: torch.dtype, *, nonfinite: bool, too_large: bool,
                 cap: int, limit: int = INT32_MAX, fingerprint: int = 0) -> None:
        """The validity / agreement round on the control slot: the same error on every worker. The
        workers' fixed-size agreement header goes first (as every transport's), so that a worker running
        another transport gets a MismatchError naming both instead of a wait for packets that never come."""
        check_agreement(self.fabric, "sparse-switch allreduce", transport=self.name, switch=self.switch,
                        slot_elems=self.k, burst=self.burst, pool_size=self.pool_size)
        self.slots.next_job(JOB_MASK + 1)
        words = [numel & 0xFFFFFFFF, (numel >> 32) & 0xFFFFFFFF, (mode << 8) | DTYPES.get(dtype, 0),
                 self.pool_size, self.k, fingerprint & 0xFFFFFFFF]
        vec = control_vector(words, self.k, nonfinite=nonfinite, too_large=too_large, cap=cap)
        got = {}

        def on_result(lane: int, res: np.ndarray):
            got["v"] = res[HEADER:].astype(np.int64)
            return None

        self.rounds.run(np.array([CONTROL_SLOT]), [self.rounds.packet(T_DATA, CONTROL_SLOT, 0, NONE, vec)], on_result,
                        "control")
        check_control(got["v"], len(words), self.fabric.world_size, "sparse-switch", _AGREE, mode=mode,
                      limit=limit, too_large=too_large_text(self.max_exponent, "job"),
                      settings="a tensor of the same length and dtype, with the same transport settings")

    # ================================================================== phase 2: look-ahead (MIN)
    def _lookahead(self, vec: np.ndarray, L: int) -> np.ndarray:
        """Element-wise minimum over workers of ``vec`` (``[-e, first positions]``), in packets of
        ``k`` values on the first lanes' slots."""
        k = self.k
        P = -(-vec.size // k)
        padded = np.full(P * k, NONE, dtype=np.int64)
        padded[:vec.size] = vec
        padded = padded.astype(np.int32).reshape(P, k)
        slots = self.slots.lane_slots(L, self.pool_size)[:P]
        out = np.empty_like(padded)

        def on_result(lane: int, res: np.ndarray):
            out[lane] = res[HEADER:]
            return None

        self.rounds.run(slots, [self.rounds.packet(T_MIN, int(s), 0, NONE, padded[i]) for i, s in enumerate(slots)],
                        on_result, "lookahead")
        return out.reshape(-1)[:vec.size].astype(np.int64)

    # ================================================================== phase 3: the block stream
    def _stream(self, codes: np.ndarray, own: np.ndarray, nxt_block: np.ndarray, first: np.ndarray,
                start: np.ndarray, L: int, nb: int) -> tuple[list[int], np.ndarray]:
        """Stream the union's blocks through ``L`` lanes (``codes[i]``: block ``own[i]``'s, this worker's
        non-zero blocks); return the blocks summed and their sums (row ``i``: block ``blocks[i]``'s ``k``
        values, copied from its result as it arrives into rows allocated for every block: pages only where
        written)."""
        # a lane's position p is block j + p L: one past the last block leaves the lane (a forged start or next
        # position would otherwise name a block the tensor does not have)
        beyond = np.arange(L) + start.astype(np.int64) * L >= nb
        if ((start < 0) | (beyond & (start != NONE)) | ((start > first) & (first != NONE))).any():
            raise ProtocolError("sparse-switch: the look-ahead round returned a lane start that no worker "
                                "can have announced (forged or corrupted packet)")
        row_of = np.full(nb, -1, dtype=np.int64)
        row_of[own] = np.arange(len(own))     # block -> its row of codes
        active = np.flatnonzero(start != NONE)
        ls = LaneStream(L, nb, active, self.slots.lane_slots(L, self.pool_size)[active],
                        cur=start.astype(np.int64), mine=first.astype(np.int64),
                        nxt_of=np.asarray(nxt_block, dtype=np.int64), row_of=row_of,
                        codes=np.ascontiguousarray(codes, dtype=np.int32))
        self.rounds.stream(ls)
        self.rounds.info["stream"].update(data=int(ls.counts[DATA]), skips=int(ls.counts[SKIPS]))
        self.slots.rotate(1, self.pool_size)
        return ls.kept()


def own_blocks(x: torch.Tensor, own: np.ndarray, k: int) -> torch.Tensor:
    """The elements of blocks ``own`` (increasing block ids) of the flat tensor ``x``, ``k`` per block, in
    order; past the end of ``x`` zeros (the last block may be partial)."""
    N = x.numel()
    full = N // k
    out = torch.zeros(len(own) * k, dtype=x.dtype)
    rows = out.view(len(own), k)
    m = int(np.searchsorted(own, full))   # the blocks before the partial one
    if m:
        torch.index_select(x[:full * k].view(full, k), 0, torch.from_numpy(own[:m]), out=rows[:m])
    if m < len(own):
        rows[m, :N - full * k] = x[full * k:]
    return out


def scatter_blocks(blocks: list[int], rows: np.ndarray, out: np.ndarray, k: int) -> None:
    """Write ``rows[i]`` (``k`` values) as block ``blocks[i]`` of the flat ``out`` (the last block may be
    partial: its first values); the other blocks are left as they are."""
    if not blocks:
        return
    N = out.size
    full = N // k
    b = np.asarray(blocks, dtype=np.int64)
    inner = b < full
    out[:full * k].reshape(full, k)[b[inner]] = rows[inner]
    if not inner.all():                   # the partial last block
        out[full * k:] = rows[np.flatnonzero(~inner)[-1], :N - full * k]
