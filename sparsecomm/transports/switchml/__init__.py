"""``switch``: SwitchML-style in-network aggregation (Sapio et al., NSDI'21, arXiv 1903.06701).

Workers stream their tensor, ``slot_elems`` int32 values per packet, through a switch endpoint that
adds the packets of all workers in a bounded pool of slots (:mod:`.dataplane`). Following the
public client (p4lang/p4app-switchML ``client_lib/src/backends/dpdk/dpdk_worker_thread.cc``,
``prepostprocessors/cpu_exponent_quantizer_ppp.cc``):

**Self-clocked slots.** A job of ``P`` packets uses ``L = min(pool_size, chunks)`` lanes; lane ``j``
owns switch slot ``1 + (j + shift) mod pool_size`` and carries packets ``j, j+L, j+2L, ...``: the
switch's result for a slot is the signal to send the lane's next packet on it. Successive uses of a
slot alternate between its two sets (SwitchML's index ``(pkt + shift) mod 2W``, kept here as a
per-slot parity so it stays right across jobs of different sizes); ``shift`` advances by ``P`` per
job. Slot 0 is the control slot (below).

**Loss recovery.** Every packet, both directions, is an unreliable datagram. A packet whose result
has not come back within ``timeout`` is sent again, unchanged; after ``timeout_threshold`` expiries
the timeout doubles and the threshold grows by ``timeout_increment`` (reference: 10 ms, 100, 100).
The switch's seen-bitmaps make a retransmission harmless: it is either dropped (slot incomplete) or
answered with the stored result (slot complete); a result for a packet that is no longer outstanding
(a duplicate, or a previous job's) is ignored. A contribution is therefore counted exactly once. (The
lanes and the retransmission timer are in :mod:`.lanes`.)

**Quantisation** (dense and aligned payloads, float tensors). Each packet carries the exponent ``e``
of its chunk's largest magnitude (``2^e > max|x|``, :func:`sparsecomm.codec.chunk_exponents`); the
switch keeps ``E = max_w e``, and the scale ``f = (INT32_MAX / n - 1) / 2^E``
(:func:`sparsecomm.codec.scale_from_exponents`; SwitchML's ``INT32_MAX / (n 2^E)`` less one unit of
headroom) makes the n-worker int32 sum impossible to overflow. The exponent exchange runs one round
ahead: the first ``L`` packets carry exponents only (SwitchML's extra batch for fp32 jobs) and packet
``p >= L`` carries chunk ``p - L``'s codes plus chunk ``p``'s exponent. On real fabrics the exponent-only
packets travel as their header alone (32 bytes each way, :mod:`.dataplane`, "Header-only packets"), and so
on a SimFabric that models a real fabric's messages (a host model's ``message_bytes``); on SimFabric's own
datagrams, as the paper's program, as whole packets. Error per element
``<= n * 0.5 / f`` (nearest rounding). A value of magnitude ``>= 2^max_exponent`` (default 2^64, about
1.8e19; the int8 exponent register would allow 2^127) is a fixed-point overflow,
:class:`~sparsecomm.errors.OverflowError_` on every worker: with such a chunk maximum the quantum
``n 2^(e-31)`` exceeds ``2^33 n``, so every ordinary value sharing its chunk would silently become 0
(one 1e30 would zero the other 63 values of its 64-value chunk). Half-precision inputs (float16,
bfloat16) are summed in float32 and the sum returned in their dtype; a sum beyond that dtype's range
(three float16 30000s) is
:class:`~sparsecomm.errors.OverflowError_` on every worker, never ``inf`` (every worker decodes the same
integer sums with the same scales, so every worker raises alike: :func:`.control.narrowed`).
``quantized`` payloads with a shared scale, and integer tensors, are summed as they are ("bypass",
SwitchML's int32 jobs). Payloads are lowered once, by the base class (:mod:`..linear`): ``aligned`` values
and ``quantized`` codes are the vector the job sums, ``dense`` payloads the tensor they stand for.

**Control round.** Before streaming, every worker sends one packet on the control slot with its
validity flags (non-finite values, magnitudes an int8 exponent or int32 cannot represent) and the
values workers must agree on (numel, dtype and kind, pool size, scale or index fingerprint), encoded
so that the switch's integer sum reveals any disagreement (``n * sum(b^2) == sum(b)^2`` for each
byte ``b``). Every worker receives the same aggregate and so raises the same error, before any data
is sent: bad input never hangs a peer. Before it, the workers exchange the fixed-size agreement header
that every transport exchanges (:mod:`.._handshake`), so that a worker running another transport gets a
:class:`~sparsecomm.errors.MismatchError` naming both, not a wait for packets (:mod:`.control`).

**Deployment.** On SimFabric the transport starts the switch as a per-port service endpoint on first
use (``fabric.service(spec, ...)``, its own line rate; lossy links via ``sc.Network(loss=p)``). On
torch.distributed the switch is the extra rank the launcher started (``services=["switch"]``); the
switch program's constants (``slot_elems``, ``burst``, ``switch_slots``) default to that rank's spec, so
the worker and the switch agree on them without the user giving them twice.

On SimFabric one packet is one datagram; on real fabrics up to ``burst`` packets share one fabric message
(each keeps its own slot semantics), the switch serves its ports in parallel and the workers keep
receives posted and their sends in flight (:mod:`.service`, :mod:`.lanes`): a software switch that adds
at the rate its ports deliver, as far as the host's CPU allows. A worker's stream is one role that the
fabric drives (:mod:`sparsecomm.fabric.roles`; its datagrams and timed waits, :mod:`.datagrams`); so is the
switch on SimFabric (on real fabrics its ports are threads, :mod:`.service`).

**Defaults** are fast where they run (:mod:`..defaults`, from the fabric's ``message_bytes``): where a
message is a datagram of a modelled network (SimFabric), the paper's program, 64-value packets one per
message, and a pool of 256 lanes (the reproductions compare these with their closed forms). On a real
fabric (gloo: a message costs the hosts a fixed CPU time beyond its bytes' worth, BENCHMARKS.md,
"Switch CPU per call") a switch started as ``"switch"`` runs 256-value packets, up to 1024 to a message (1 MiB),
and a worker keeps 8191 lanes in flight (eight messages per lane window, :data:`..defaults.WINDOW_MESSAGES`). A message holds only the packets that are ready
(:mod:`.lanes`), so a small job costs its packets' bytes, not a burst's. A float job's first lane window carries
exponents only (above, "Quantisation"), a header per lane; a float job of ``M`` chunks keeps at most ``M / 2``
lanes in flight (at least ``min(M, 256)``; :meth:`SwitchTransport._float_lanes`), four messages per lane window.
Per call a worker sends (and receives) the tensor's int32 codes in packets of ``slot_elems`` (the last one
padded) with a 32-byte header each, a 32-byte header per look-ahead lane and one more per message of them, one
whole control packet and the agreement header: 4.9% over the gradient for the 4.5 MB MLP of
``experiments/reproduce_training.py`` under the DDP hook (4.725 MB a step), 3.1% of it the data packets'
headers, 1.6% the look-ahead's.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ... import codec
from ...errors import IncompatibleError, InvalidValueError, NonFiniteError
from ...fabric.base import Fabric
from .. import defaults
from .._guards import check_dtype
from .._handshake import check_agreement
from ...theory import costs
from ..base import CallShape, Transport, registry
from ..linear import LinearOperand, fresh_copy
from .control import (AGREE, CONTROL_SLOT, DEFAULT_MAX_EXPONENT, DTYPES, KINDS, MODE_FLOAT, MODE_INT, ROUNDING,
                      check_control, control_vector, max_exponent_option, narrowed, started_program,
                      too_large_text)
from .dataplane import EXP_MAX, HEADER, WIDEST, Dataplane, SwitchConfig
from .jobs import FloatJob, IntJob
from .lanes import Lanes, SlotState, Timer
from .service import serve, serve_process, service_main

INT32_MAX = 2**31 - 1
#: real fabrics, default pool: a float job's lanes, hence its exponent look-ahead round (its first ``L``
#: packets, one per lane, each a header that carries an exponent and no codes, 32 bytes each way), are at
#: most this share of its chunks: the job streams in two lane windows. The window is what a worker has in
#: flight, and the link stays busy only while it outlasts a message's round trip through the switch (its
#: bytes up, the program, its results down, the decode and the next encode: about 7 ms for a 273 KB message
#: on a 2-host netbed at 1 Gbit/s, whose 2 cores the switch shares with the workers); a 4.4 MB job's
#: window is then 2.2 MB (17 ms of its link) for 50 KB more headers each way than an eighth of it, whose
#: 0.55 MB (4.4 ms) left the link idle a third of the time ...
LOOKAHEAD_SHARE = 2
#: ... unless the job has no more chunks than this (a small job keeps its two lane windows) ...
LOOKAHEAD_FLOOR = 256
#: ... and its lane window is split into this many messages (fewer, smaller windows than the default pool's:
#: a message costs the hosts about as much CPU as 0.3 MB of the tensor, BENCHMARKS.md "Switch CPU per call";
#: with four per window the workers send its next messages while the switch answers the ones before)
LOOKAHEAD_MESSAGES = 4
EXP_FLOOR = -126          # float32's smallest reported exponent; also used for float64 (safe: 2^e > max|x|)


@dataclass
class FixedResult:
    """The integer side of the last float job: the switch's int32 sums, the agreed exponents, scales."""

    sums: torch.Tensor        # int32, numel elements
    exponents: torch.Tensor   # int32, one per chunk (max over workers)
    scales: torch.Tensor      # float64, one per chunk: q = round(x * scale)
    chunk: int


_lock = threading.Lock()


@registry.register("switch")
class SwitchTransport(Transport):
    """SwitchML allreduce against a switch endpoint (see the module docstring).

    ``pool_size``: slots (lanes) a job keeps in flight, ``<= switch_slots - 1`` (default: 256 on
    SimFabric, ``4 * burst`` elsewhere; module docstring, "Defaults"); ``slot_elems``: 64 or 256 int32
    values per packet (default: 64 on SimFabric, 256 elsewhere). ``timeout``: retransmission timer (modelled seconds on SimFabric,
    default 10 ms as the reference client; wall seconds elsewhere, default ``None``: no timer, since
    gloo/TCP never drops a message and a timed wait costs TorchFabric a helper thread; waits are then
    bounded by the fabric's ``timeout_s``; ``None`` too on a SimFabric that takes a real fabric's defaults,
    a host model with a cost per message: pass one there for a lossy network). ``rounding``: ``"nearest"`` or ``"stochastic"``
    (with ``seed``). ``burst``: packets per fabric message (default 1 on SimFabric, elsewhere as many as
    fill 1 MiB: 1024 of 256 values).
    ``switch_slots`` (default 8192), ``burst``, ``slot_elems``, ``switch_workers`` (the most workers its
    bitmap holds, a multiple of 32; default: 32, or the job's workers rounded up to a multiple of 32 past 32,
    :class:`.dataplane.SwitchConfig`) and ``audit`` (count every accepted contribution, tests only) are
    compile-time constants of the switch program and name its service (``SwitchConfig.spec()``); on real
    fabrics they default to the started switch's.
    ``inplace``: a contiguous float32/float64 CPU tensor input receives the sum (no result tensor to
    allocate; as ``native``'s option). ``keep_fixed``: after each float job, ``last_fixed`` holds its
    integer side (:class:`FixedResult`: the switch's int32 sums, the agreed exponents and scales), for
    tests and diagnostics; it costs one more write of the whole tensor's sums per call, so by default
    (``False``) it is not kept and ``last_fixed`` is ``None``. ``last_fixed.sums`` is reused by the next
    job: clone it to keep it.
    ``bandwidth_gbps``/``latency_us`` set the switch's link on SimFabric. ``give_up_s``: a packet unanswered for that long (default: the
    fabric's ``timeout_s``) raises :class:`FabricTimeout`.
    """

    name = "switch"
    sums_nonfinite = False
    carries = frozenset({"dense", "aligned", "quantized"})
    quantized_needs_shared_scale = True
    linear = frozenset({"aligned", "quantized"})

    def __init__(self, fabric: Fabric, *, pool_size: int | None = None, slot_elems: int | None = None,
                 timeout: float | None = None, timeout_threshold: int = 100, timeout_increment: int = 100,
                 rounding: str = "nearest", seed: int = 0, burst: int | None = None,
                 switch_slots: int | None = None, bandwidth_gbps: float | None = None,
                 latency_us: float | None = None, give_up_s: float | None = None, audit: bool = False,
                 max_exponent: int = DEFAULT_MAX_EXPONENT, nonfinite: str = "raise", inplace: bool = False,
                 keep_fixed: bool = False, switch_workers: int | None = None) -> None:
        super().__init__(fabric)
        if nonfinite != "raise":
            raise IncompatibleError(
                f"transport 'switch' sums fixed-point integers, which cannot carry NaN/Inf, so it only "
                f"supports nonfinite='raise' (got {nonfinite!r}); transports that can pass them through: "
                f"ring, native, allgather, omnireduce")
        self.nonfinite = nonfinite
        self.max_exponent = max_exponent_option(max_exponent, EXP_FLOOR, EXP_MAX)
        self.sim = fabric.modelled_time
        self.config, spec = started_program(fabric, SwitchConfig, slot_elems, switch_slots, burst, audit,
                                            workers=switch_workers)
        slot_elems, switch_slots = self.config.elems, self.config.slots
        #: a float job's lanes follow its size (:meth:`_float_lanes`): the default pool of a real fabric
        self.sized_lanes = pool_size is None and fabric.message_bytes is not None
        if pool_size is None:
            pool_size = defaults.pool_size(fabric, self.config.burst, switch_slots)
        if not fabric.is_worker:
            raise IncompatibleError("the switch transport runs on workers, not on a service endpoint")
        if fabric.world_size > self.config.width:
            width = self.config.width
            raise IncompatibleError(
                f"transport 'switch' supports at most {width} workers with this switch program (its worker "
                f"bitmap per slot is {width // 32} 32-bit word(s), switch_workers={width}); this job has "
                f"{fabric.world_size}; leave switch_workers unset (the job's size, up to {WIDEST}) or start "
                f"the switch for more (services=['switch:workers=...']), or use 'ring' or 'omnireduce'")
        if not isinstance(pool_size, int) or not 1 <= pool_size <= switch_slots - 1:
            raise InvalidValueError(f"pool_size must be an integer in [1, switch_slots - 1 = {switch_slots - 1}] "
                             f"(slot 0 is the control slot), got {pool_size!r}")
        if rounding not in ROUNDING:
            raise InvalidValueError(f"rounding must be one of {sorted(ROUNDING)}, got {rounding!r}")
        if timeout is None and self.sim and fabric.message_bytes is None:   # the papers' defaults (..defaults)
            timeout = 10e-3
        if timeout is not None and not timeout > 0:
            raise InvalidValueError(f"timeout must be positive (or None: no timer), got {timeout!r}")
        self.pool_size, self.slot_elems = pool_size, slot_elems
        self.timeout = None if timeout is None else float(timeout)
        self.timeout_threshold, self.timeout_increment = int(timeout_threshold), int(timeout_increment)
        self.rounding, self.seed = rounding, int(seed)
        self.give_up_s = float(give_up_s if give_up_s is not None else fabric.timeout_s)
        self.burst = self.config.burst
        self.dataplane: Dataplane | None = None
        if fabric.in_process_services:
            with _lock:
                per_world = fabric.world_scratch.setdefault("switch/dataplanes", {})
                self.dataplane = per_world.setdefault(spec, Dataplane(self.config))
            main = functools.partial(serve_process if fabric.modelled_time else serve, self.dataplane)
        else:
            main = service_main(self.config)
        link = {k: v for k, v in (("bandwidth_gbps", bandwidth_gbps), ("latency_us", latency_us)) if v is not None}
        self.switch = fabric.service(spec, main, per_port=True, **link)
        with _lock:
            per_fabric = fabric.scratch.setdefault("switch/worker_states", {})
            #: the program's slots, kept across jobs and shared by this fabric's transports talking to it
            self.slots = per_fabric.setdefault(spec, SlotState(parity=np.zeros(switch_slots, dtype=np.int32)))
        self.lanes = Lanes(fabric, self.switch, self.slots, slot_elems, self.burst,
                           Timer(self.timeout, self.timeout_threshold, self.timeout_increment, self.give_up_s))
        self.last_fixed: FixedResult | None = None
        self.inplace = bool(inplace)
        self.keep_fixed = bool(keep_fixed)
        self._sums: torch.Tensor | None = None

    @property
    def last_info(self) -> dict:
        """The last job's per-phase packet counts (:attr:`.lanes.Lanes.info`)."""
        return self.lanes.info

    def wire_copies(self) -> float:
        """Each worker streams its tensor to the switch once (32-bit fixed point per value)."""
        return 1.0

    def cost(self, call: CallShape, *, bandwidth_gbps: float, latency_us: float) -> costs.Cost:
        """:func:`~sparsecomm.theory.costs.switchml_allreduce` of the call's elements as 32-bit fixed point,
        with this transport's slots and the lanes a float job of that size takes (:meth:`_float_lanes`), its
        exponent look-ahead header-only where messages are a real fabric's (a SimFabric's with a host model's
        ``message_bytes`` too)."""
        lanes = self._float_lanes(-(-call.numel // self.slot_elems))[0]
        return costs.switchml_allreduce(self.fabric.world_size, call.numel * 4, pool_size=max(1, lanes),
                                        slot_elems=self.slot_elems, bandwidth_gbps=bandwidth_gbps,
                                        latency_us=latency_us,
                                        header_only_lookahead=not self.sim or self.fabric.message_bytes is not None)

    # ================================================================== payload kinds
    def _allreduce_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.is_floating_point():
            return self._float_job(flat, "tensor", inplace=self.inplace)
        check_dtype(flat.dtype, "switch", tuple(DTYPES))     # float or one of the switch's integer dtypes
        return self._int_job(flat, flat.dtype, "tensor")

    def _sum_linear(self, op: LinearOperand) -> torch.Tensor:
        """An ``aligned`` operand's values (float: fixed point) or a ``quantized`` one's codes (exactly,
        "bypass"), with the shared indices' or scale's checksum in the control round."""
        v = op.vector
        if v.is_floating_point():
            return self._float_job(v, op.kind, fingerprint=op.check)
        return self._int_job(v, torch.int64 if op.codes else v.dtype, op.kind, fingerprint=op.check)

    # ================================================================== float (fixed point) job
    def _float_job(self, flat: torch.Tensor, kind: str, fingerprint: int = 0, inplace: bool = False) -> torch.Tensor:
        out_dtype, device = flat.dtype, flat.device
        x = flat.detach().reshape(-1).to("cpu")
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        x = x.contiguous()
        N, E, n = x.numel(), self.slot_elems, self.fabric.world_size
        finite, too_large = True, False
        e_loc = np.zeros(0, dtype=np.int64)
        if N:
            try:      # one pass: the exponents' scan reports a NaN/Inf too
                e_loc = np.maximum(codec.chunk_exponents(x, E).numpy().astype(np.int64), EXP_FLOOR)
                too_large = bool(e_loc.max() > self.max_exponent)
            except NonFiniteError:
                finite = False
        self._control(MODE_FLOAT, N, flat.dtype, kind, fingerprint, nonfinite=not finite,
                      too_large=too_large, cap=0, limit=INT32_MAX)
        M = -(-N // E)
        if M == 0:
            self.last_fixed = None
            return torch.zeros(0, dtype=out_dtype, device=device)
        job_seed = None
        if self.rounding == "stochastic":
            job_seed = int(np.random.SeedSequence([self.seed, self.fabric.rank, self.slots.job]).generate_state(1)[0])
        # in place: each chunk is encoded (read) before its result arrives (written), so x can take the sum
        out = x if inplace and x.data_ptr() == flat.data_ptr() else torch.empty(N, dtype=x.dtype)
        if out is not x:      # (a result allocated per call, its pages touched as its chunks are decoded: sim_host)
            self.fabric.host_work("fresh_later", out.nbytes)
        sums = self._sums_buffer(M * E) if self.keep_fixed else None
        self.last_fixed = None
        lanes, rows = self._float_lanes(M)
        job = FloatJob(x, out, sums, e_loc, E, lanes, n, job_seed)
        self._stream(job, lanes, rows, touch=out is not x and self.fabric.charges_host_work)
        if sums is not None:
            eg_t = torch.from_numpy(job.exponents.astype(np.int32))
            scales = codec.scale_from_exponents(eg_t, n)
            self.last_fixed = FixedResult(sums[:N], eg_t, scales, E)
        return narrowed(out, out_dtype, "switch").to(device)

    def _float_lanes(self, chunks: int) -> tuple[int, int | None]:
        """``(lanes, packets per message)`` of a float job of ``chunks`` chunks.

        The job's first ``lanes`` packets carry only their chunk's exponent (:mod:`.jobs`: the look-ahead
        that lets each chunk's codes use the agreed scale), header-only on a real fabric (a whole packet of
        zeros on SimFabric's own datagrams), so the job sends ``chunks + lanes`` packets. With ``pool_size`` given, or on
        SimFabric (the paper's pool of 256 lanes, which the closed forms model): ``min(pool_size, chunks)``
        lanes, ``burst`` packets per message. With a real fabric's default pool (8191 lanes): at most
        ``chunks / LOOKAHEAD_SHARE`` lanes (half; at least ``min(chunks, LOOKAHEAD_FLOOR)``),
        ``LOOKAHEAD_MESSAGES`` messages per lane window, so the workers still send a window's next messages
        while the switch answers the ones before. The lanes change neither a chunk's scale nor its codes: the
        sums are the same bit for bit."""
        lanes = min(self.pool_size, chunks)
        if not self.sized_lanes:
            return lanes, None
        lanes = min(lanes, max(LOOKAHEAD_FLOOR, -(-chunks // LOOKAHEAD_SHARE)))
        return lanes, min(self.burst, max(1, -(-lanes // LOOKAHEAD_MESSAGES)))

    def _sums_buffer(self, size: int) -> torch.Tensor:
        """The int32 sums of a float job (``last_fixed.sums``), reused by the next job of the same size."""
        if self._sums is None or self._sums.numel() != size:
            self._sums = torch.zeros(size, dtype=torch.int32)
        return self._sums

    # ================================================================== integer ("bypass") job
    def _int_job(self, flat: torch.Tensor, out_dtype: torch.dtype, kind: str, fingerprint: int = 0) -> torch.Tensor:
        device = flat.device
        v = flat.detach().reshape(-1).to("cpu", torch.int64)
        N, E = v.numel(), self.slot_elems
        amax = int(v.abs().max()) if N else 0
        too_large = amax > INT32_MAX
        limit = INT32_MAX if out_dtype.is_floating_point else min(INT32_MAX, torch.iinfo(out_dtype).max)
        self._control(MODE_INT, N, flat.dtype, kind, fingerprint, nonfinite=False, too_large=too_large,
                      cap=min(amax, INT32_MAX), limit=limit)
        M = -(-N // E)
        if M == 0:
            return torch.zeros(0, dtype=out_dtype, device=device)
        vp = torch.zeros(M * E, dtype=torch.int32)
        vp[:N] = v.to(torch.int32)
        job = IntJob(vp.view(M, E))
        f = self.fabric
        f.host_work("fresh", vp.nbytes)                     # (the codes and sums allocated per call: sim_host)
        f.host_work("fresh", job.sums.nbytes)
        self._stream(job)
        total = fresh_copy(f, torch.from_numpy(job.sums.reshape(-1)[:N].copy()))
        return total.to(device=device, dtype=out_dtype)

    # ================================================================== control round
    def _control(self, mode: int, numel: int, dtype: torch.dtype, kind: str, fingerprint: int, *,
                 nonfinite: bool, too_large: bool, cap: int, limit: int) -> None:
        """The validity / agreement round on the control slot (module docstring, "Control round"); raises
        the same error on every worker."""
        # the workers' fixed-size agreement header first (as every transport exchanges it): ranks that run
        # another transport get a MismatchError naming both sides instead of a wait for packets that never
        # come; the values the control round checks (numel, dtype, kind, scale) are not repeated here
        check_agreement(self.fabric, "switch allreduce", transport=self.name, switch=self.switch,
                        slot_elems=self.slot_elems, burst=self.burst, pool_size=self.pool_size)
        self.slots.next_job(2**31 - 1)
        words = [numel & 0xFFFFFFFF, (numel >> 32) & 0xFFFFFFFF,
                 (mode << 16) | (DTYPES.get(dtype, 0) << 8) | (KINDS[kind] << 4) | ROUNDING[self.rounding],
                 self.pool_size, self.slot_elems, fingerprint & 0xFFFFFFFF]
        vec = control_vector(words, self.slot_elems, nonfinite=nonfinite, too_large=too_large, cap=cap)
        agg = {}

        def payload(pkts: np.ndarray, rows: np.ndarray) -> None:
            rows[:, HEADER:] = vec

        def consume(pkts: np.ndarray, rows: np.ndarray) -> None:
            agg["v"] = rows[0, HEADER:].astype(np.int64)

        self.lanes.run(np.array([CONTROL_SLOT]), 1, -1, payload, consume, "control")
        check_control(agg["v"], len(words), self.fabric.world_size, "switch", AGREE, mode=mode, limit=limit,
                      too_large=too_large_text(self.max_exponent, "chunk"),
                      settings="a tensor/payload of the same shape, dtype and kind (and the same transport "
                               "settings)")

    # ================================================================== streaming
    def _stream(self, job: FloatJob | IntJob, lanes: int | None = None, rows: int | None = None,
                touch: bool = False) -> None:
        """Stream a job's packets through the pool (:meth:`.lanes.Lanes.run`) on ``lanes`` lanes (default
        ``min(pool_size, chunks)``), ``rows`` packets per message at most (default ``burst``); the job's
        encoder fills them and its decoder takes the results (:mod:`.jobs`); ``touch``: each result's chunk
        declared as written into a fresh result (``host_work("fresh_touch")``, where it is charged)."""
        lanes = min(self.pool_size, job.M) if lanes is None else lanes
        lane_slots = self.slots.lane_slots(lanes, self.pool_size)
        consume = job.consume
        if touch:
            f, chunk = self.fabric, job.E * job.onp.itemsize

            def consume(pkts: np.ndarray, rows: np.ndarray) -> None:
                job.consume(pkts, rows)
                f.host_work("fresh_touch", int(np.count_nonzero(pkts >= job.pre)) * chunk)

        self.lanes.run(lane_slots, job.packets, 0, job.payload, consume, "data", rows=rows, short_below=job.pre)
        self.slots.rotate(job.packets, self.pool_size)

