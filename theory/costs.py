"""Closed-form alpha-beta communication costs of the transports, per worker, for ``n`` workers.

The model is the SimFabric's (``sparsecomm/fabric/sim/``), so that a closed form here and a simulated
run agree (``tests/theory/test_costs.py`` checks it within 10 % for n in {2, 4, 8, 16, 64}):

- every endpoint has a full-duplex NIC of ``B`` bytes/s (``bandwidth_gbps * 1e9 / 8``) and a per-message
  latency ``alpha`` (``latency_us * 1e-6``);
- a message of ``m`` bytes on an idle path takes ``alpha + m / B``;
- a NIC serialises its sends, and (separately) its receives; consecutive messages pipeline, so a burst
  of ``k`` messages of ``m`` bytes to distinct peers arrives after ``alpha + k m / B``;
- local computation (additions, packing) is free unless a protocol calls ``fabric.compute``.

Every function returns a :class:`Cost` for one call: modelled time, bytes and messages per worker
(averaged over workers where the load is uneven), and the latency steps on the critical path. Sizes are
in bytes. Each transport's agreement handshake (``sparsecomm/transports/_handshake.py``: ``ceil(log2 n)``
rounds of one fixed-size message of ``HANDSHAKE_BYTES``) is included where the transport performs it.

This is a flat module of plain functions; each transport's model sits in its own section, with its
formula and paper in the docstring.
"""

# Longer than 400 lines because every transport's model is one section of a single table (``MODELS``):
# they share ``link``, ``handshake`` and ``Cost``, and are read and compared side by side.

from __future__ import annotations

import math
from typing import NamedTuple

from sparsecomm.errors import InvalidValueError


class Cost(NamedTuple):
    """Cost of one collective call, per worker."""

    time_s: float
    bytes_sent: float
    bytes_received: float
    messages: float          # messages sent
    steps: int               # latency steps on the critical path


ZERO = Cost(0.0, 0.0, 0.0, 0.0, 0)


def link(bandwidth_gbps: float = 100.0, latency_us: float = 2.0) -> tuple[float, float]:
    """``(B, alpha)``: bytes per second and seconds per message of a NIC.

    Args:
        bandwidth_gbps: the NIC's rate, Gbit/s: B = bandwidth_gbps 1e9 / 8 bytes/s.
        latency_us: its latency, microseconds: alpha = latency_us 1e-6 s.
    """
    if bandwidth_gbps <= 0 or latency_us < 0:
        raise InvalidValueError("bandwidth must be positive and latency non-negative")
    return bandwidth_gbps * 1e9 / 8, latency_us * 1e-6


def add(*costs: Cost) -> Cost:
    """Costs of phases run one after the other.

    Args:
        *costs: the phases' costs, in order.
    """
    return Cost(*(sum(c[i] for c in costs) for i in range(len(Cost._fields))))


# ----------------------------------------------------------------------------- agreement handshake
HANDSHAKE_FIELD_BYTES = 32          # (min, argmin, max, argmax) as int64, per word of the header
#: every handshake message, whatever the number of fields: a 34-word int64 header (preamble, 16 field
#: slots, merge state, the call's identity, checksum): sparsecomm.transports._handshake.HEADER_BYTES
HANDSHAKE_BYTES = 8 * 34
#: handshake fields of the ring / native transports per operand kind (plain tensors count as dense)
RING_HANDSHAKE_FIELDS = {"dense": 6, "aligned": 7, "quantized": 8}


def handshake(n: int, fields: int, *, bandwidth_gbps: float = 100.0, latency_us: float = 2.0) -> Cost:
    """Dissemination min/max of ``fields`` int64 fields: ``ceil(log2 n)`` rounds, each one message of
    ``m = HANDSHAKE_BYTES`` (a fixed-size header, whatever ``fields``) to ``r + 2^k`` and one from
    ``r - 2^k``: ``T = ceil(log2 n) (alpha + m / B)``.

    Args:
        n: workers.
        fields: int64 fields of the header.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
    """
    if n <= 1 or fields <= 0:
        return ZERO
    B, alpha = link(bandwidth_gbps, latency_us)
    rounds = (n - 1).bit_length()
    m = HANDSHAKE_BYTES
    return Cost(rounds * (alpha + m / B), rounds * m, rounds * m, rounds, rounds)


# ----------------------------------------------------------------------------- ring
RING_SEGMENT_BYTES = 4 << 20        # the ring transport's longest default segment (sparsecomm/transports/ring.py)
RING_MIN_SEGMENT_BYTES = 1 << 20    # by default a chunk of twice this or more travels in >= 2 segments (same)


def ring_allreduce(n: int, nbytes: int, *, elem_size: int = 4, bandwidth_gbps: float = 100.0,
                   latency_us: float = 2.0, handshake_fields: int = RING_HANDSHAKE_FIELDS["dense"],
                   segment_bytes: int | None = None) -> Cost:
    """Ring all-reduce (reduce-scatter + all-gather) of ``nbytes`` per worker.

    ``n`` chunks of at most ``c = ceil(N / n) * elem_size`` bytes (``N = nbytes / elem_size``), ``2 (n-1)``
    steps, in each of which every worker sends one chunk to its right neighbour and receives one from its
    left. Unsegmented (``c <= segment_bytes``)::

        T = handshake + 2 (n-1) (alpha + c / B)

    Chunks travel as pipelined segments of ``s = min(segment_bytes, c)`` bytes; by default (``None``)
    ``segment_bytes`` is :data:`RING_SEGMENT_BYTES`, or half the chunk (rounded up to an element) when that
    half is at least :data:`RING_MIN_SEGMENT_BYTES` and shorter (a segment is forwarded as
    soon as it has arrived and been added), so the time is the larger of the first segment's trip
    through the ``2 (n-1)`` hops, followed by the rest of its chunk, and the ``2 (n-1) c`` bytes that
    every NIC must send after one latency::

        T = handshake + max(2 (n-1) (alpha + s / B) + (c - s) / B,  alpha + 2 (n-1) c / B)

    (which is the unsegmented formula when ``s = c``). Bytes sent = received =
    ``2 (n-1)/n * nbytes`` per worker on average (for ``N >= n``; empty chunks are not sent).

    Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009.

    Args:
        n: workers.
        nbytes: bytes per worker.
        elem_size: bytes per element.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        handshake_fields: int64 fields of the transport's agreement header (:func:`handshake`).
        segment_bytes: see above.
    """
    if n <= 1:
        return ZERO
    B, alpha = link(bandwidth_gbps, latency_us)
    numel = nbytes // elem_size
    chunk = math.ceil(numel / n) * elem_size
    if segment_bytes is None:
        segment_bytes = RING_SEGMENT_BYTES
        half = math.ceil(chunk / elem_size / 2) * elem_size
        if half >= RING_MIN_SEGMENT_BYTES:
            segment_bytes = min(segment_bytes, half)
    seg = min(max(elem_size, (segment_bytes // elem_size) * elem_size), chunk)
    steps = 2 * (n - 1)
    moved = 2 * (n - 1) * nbytes / n
    if chunk:
        time_s = max(steps * (alpha + seg / B) + (chunk - seg) / B, alpha + steps * chunk / B)
    else:
        time_s = 0.0
    messages = steps * math.ceil(chunk / seg) if chunk else 0
    ring = Cost(time_s, moved, moved, messages, steps)
    return add(handshake(n, handshake_fields, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us), ring)


def native_allreduce(n: int, nbytes: int, **kw) -> Cost:
    """What the ``native`` transport books for ``torch.distributed.all_reduce`` (it cannot measure it):
    the ring's volume and steps, :func:`ring_allreduce`.

    Args:
        n: workers.
        nbytes: bytes per worker.
        **kw: as for :func:`ring_allreduce`.
    """
    return ring_allreduce(n, nbytes, **kw)


# ----------------------------------------------------------------------------- allgather
ALLGATHER_HEADER_BYTES = HANDSHAKE_BYTES   # allgather's headers (6 scalars + (count, dtype, encoding) of
#                                            3 wire slots) travel in the handshake's fixed-size format


def allgather(n: int, payload_bytes: float, *, tensors: int = 1, bandwidth_gbps: float = 100.0,
              latency_us: float = 2.0, header_bytes: int = ALLGATHER_HEADER_BYTES) -> Cost:
    """Every worker's payload (``payload_bytes`` on the wire, in ``tensors`` messages) to every other.

    Sizes first: every worker sends its ``h``-byte header to the ``n-1`` others, and once it has all
    headers, its payload; a receive NIC serialises the ``n-1`` incoming messages of each phase, which
    pipeline behind one latency:

        T = 2 alpha + (n-1) (h + P) / B        (alpha + (n-1) h / B for an empty payload)
        bytes sent = bytes received = (n-1) (h + P)

    (SparCML, Renggli et al., SC'19; the "AGsparse" baseline of OmniReduce.)

    Args:
        n: workers.
        payload_bytes: P, each worker's payload on the wire.
        tensors: messages the payload takes.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        header_bytes: h, the size header's bytes.
    """
    if n <= 1:
        return ZERO
    B, alpha = link(bandwidth_gbps, latency_us)
    per_peer = header_bytes + payload_bytes
    phases = 2 if payload_bytes > 0 else 1
    msgs = (n - 1) * (1 + (tensors if payload_bytes > 0 else 0))
    return Cost(phases * alpha + (n - 1) * per_peer / B, (n - 1) * per_peer, (n - 1) * per_peer, msgs, phases)


# ----------------------------------------------------------------------------- SwitchML (switch)
SWITCHML_HEADER_BYTES = 8 * 4      # int32 header of every packet (sparsecomm/transports/switchml/dataplane.py)
#: the switch workers' agreement header fields (switch rank, slot_elems, burst, pool_size: sparsecomm/transports/switchml/)
SWITCHML_HANDSHAKE_FIELDS = 4


def switchml_allreduce(n: int, nbytes: int, *, elem_size: int = 4, pool_size: int = 256, slot_elems: int = 64,
                       fp32: bool = True, bandwidth_gbps: float = 100.0, latency_us: float = 2.0,
                       switch_bandwidth_gbps: float | None = None, switch_latency_us: float | None = None,
                       header_bytes: int = SWITCHML_HEADER_BYTES,
                       handshake_fields: int = SWITCHML_HANDSHAKE_FIELDS,
                       header_only_lookahead: bool = False) -> Cost:
    """SwitchML in-network aggregation (Sapio et al., NSDI'21, arXiv 1903.06701) of ``nbytes`` per worker.

    Every worker sends each element once and receives the sum once, whatever ``n`` (<= 32): packets of
    ``b = header + k * 4`` bytes (``k = slot_elems``) for ``M = ceil(N / k)`` chunks, plus ``L`` exponent-only
    packets for fp32 jobs (``L = min(pool_size, M)`` lanes, one slot each), plus one control packet.
    With ``tau = b / min(B, B_switch)`` and the idle round trip ``RTT = alpha + alpha_s + 2 b / min(B, B_s)``,
    packet ``p`` starts at ``s_p = max(s_{p-1} + tau, s_{p-L} + RTT)`` (NIC serialisation, self-clocked
    slot reuse), i.e. for ``P`` data packets:

        T = RTT (control) + max((P-1) tau, floor((P-1)/L) RTT + ((P-1) mod L) tau) + RTT

    so the throughput is ``min(line rate, pool_size * slot_bytes / RTT)``: flat in ``n``, rising with the
    pool until it covers the bandwidth-delay product. Bytes sent = bytes received = ``(1 + P) b``. Before
    the control packet the workers exchange the agreement header among themselves (:func:`handshake`, the
    only term that grows with ``n``: ``ceil(log2 n)`` small messages), so that a worker running another
    transport is told so instead of waiting for the switch.
    The switch is per-port (one NIC per worker), as SimFabric's ``per_port=True`` models it.

    ``header_only_lookahead`` (the library's switch on a real fabric): the ``L`` exponent-only packets are
    headers alone, ``h`` bytes with ``tau_h = h / min(B, B_s)`` and ``RTT_h = alpha + alpha_s + 2 tau_h``;
    the ``M`` data packets then start once the first look-ahead result is in and the look-ahead window is
    serialised, ``max(RTT_h, L tau_h)`` after the control round, and run as above: bytes sent = received =
    ``(1 + M) b + L h``.

    Args:
        n: workers.
        nbytes: bytes per worker.
        elem_size: bytes per element of the input.
        pool_size: slots (lanes) of the switch's pool.
        slot_elems: k, values per packet.
        fp32: a float job (adds the exponent packets).
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        switch_bandwidth_gbps: the switch ports' rate, Gbit/s (default: ``bandwidth_gbps``).
        switch_latency_us: the switch's latency, microseconds (default: ``latency_us``).
        header_bytes: bytes of each packet's header.
        handshake_fields: int64 fields of the transport's agreement header (:func:`handshake`).
        header_only_lookahead: a float job's exponent-only packets are headers alone (above).
    """
    if n < 1:
        return ZERO
    B, alpha = link(bandwidth_gbps, latency_us)
    Bs, alpha_s = link(switch_bandwidth_gbps if switch_bandwidth_gbps is not None else bandwidth_gbps,
                       switch_latency_us if switch_latency_us is not None else latency_us)
    b = header_bytes + slot_elems * 4
    tau = b / min(B, Bs)
    rtt = alpha + alpha_s + 2 * tau
    numel = nbytes // elem_size
    M = math.ceil(numel / slot_elems)
    L = min(pool_size, M)
    if fp32 and header_only_lookahead and M:
        tau_h = header_bytes / min(B, Bs)
        t = rtt + max(alpha + alpha_s + 2 * tau_h, L * tau_h)
        t += max((M - 1) * tau, ((M - 1) // L) * rtt + ((M - 1) % L) * tau) + rtt
        moved = (1 + M) * b + L * header_bytes
        return add(handshake(n, handshake_fields, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us),
                   Cost(t, moved, moved, 1 + L + M, 2 + math.ceil(M / L)))
    P = M + (L if fp32 else 0)
    t = rtt
    if P:
        last = max((P - 1) * tau, ((P - 1) // L) * rtt + ((P - 1) % L) * tau)
        t += last + rtt
    moved = (1 + P) * b
    steps = 1 + (math.ceil(P / L) if P else 0)
    return add(handshake(n, handshake_fields, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us),
               Cost(t, moved, moved, 1 + P, steps))


def switchml_throughput(*, pool_size: int = 256, slot_elems: int = 64, bandwidth_gbps: float = 100.0,
                        latency_us: float = 2.0, header_bytes: int = SWITCHML_HEADER_BYTES) -> float:
    """Steady-state goodput in payload bytes/s: ``min(k*4 / tau, pool_size * k*4 / RTT)`` (see above).

    Args:
        pool_size: slots of the switch's pool.
        slot_elems: k, values per packet.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        header_bytes: bytes of each packet's header.
    """
    B, alpha = link(bandwidth_gbps, latency_us)
    b = header_bytes + slot_elems * 4
    tau = b / B
    rtt = 2 * (alpha + tau)
    return min(slot_elems * 4 / tau, pool_size * slot_elems * 4 / rtt)


def switchml_lossy_time(n: int, nbytes: int, loss: float, *, timeout_s: float = 10e-3, **kw) -> float:
    """Expected time with datagram loss ``loss`` on every link (a rough model, for plots only).

    A lost packet costs its lane one retransmission timeout, and a retransmission can be lost again, so a
    packet needs ``G ~ Geometric`` extra timer periods (``P(G >= k) = loss^k``). The switch keeps the
    contributions that did arrive (seen-bitmaps), so a round on a slot waits for the worst of its ``2n``
    packets (n up, n down): ``X = max of 2n such G``, ``P(X <= k) = (1 - loss^(k+1))^(2n)``. A lane runs
    ``R`` rounds (its data packets plus the control round) and the job waits for its slowest lane:

        T ~= T_0 + timeout * E[max over L lanes of (X_1 + ... + X_R)]

    Ignores the timer doubling after repeated expiries and the pipelining of other lanes around a
    stalled one.

    Args:
        n: workers.
        nbytes: bytes per worker.
        loss: see above.
        timeout_s: the retransmission timeout, seconds.
        **kw: as for :func:`switchml_allreduce`.
    """
    base = switchml_allreduce(n, nbytes, **kw)
    if loss <= 0:
        return base.time_s
    slot_elems = kw.get("slot_elems", 64)
    M = math.ceil((nbytes // kw.get("elem_size", 4)) / slot_elems)
    L = min(kw.get("pool_size", 256), M)
    P = M + (L if kw.get("fp32", True) else 0)
    R = math.ceil(P / L) + 1
    K = 1                                       # support of X: P(X > K) negligible
    while 1.0 - (1.0 - loss ** (K + 1)) ** (2 * n) > 1e-12:
        K += 1
    cdf_x = [(1.0 - loss ** (k + 1)) ** (2 * n) for k in range(K + 1)]
    pmf_x = [cdf_x[0]] + [cdf_x[k] - cdf_x[k - 1] for k in range(1, K + 1)]
    pmf_s = [1.0]
    for _ in range(R):                          # distribution of the sum over R rounds
        out = [0.0] * (len(pmf_s) + K)
        for i, a in enumerate(pmf_s):
            if a:
                for j, b in enumerate(pmf_x):
                    out[i + j] += a * b
        pmf_s = out
    expect, cdf = 0.0, 0.0
    for a in pmf_s:                             # E[max of L iid] = sum_k P(max > k)
        cdf += a
        expect += max(0.0, 1.0 - min(cdf, 1.0) ** L)
    return base.time_s + timeout_s * expect


# ----------------------------------------------------------------------------- omnireduce
OMNIREDUCE_HEADER_BYTES = 8 * 28    # round-0 header (and reply), int64[12 + 16 channels], per worker and aggregator
OMNIREDUCE_LOOKAHEAD_BYTES = 4      # the "next non-zero block" offset riding with each block


def _expected_max_binomial(trials: int, p: float, count: int) -> float:
    """``E[max of count iid Binomial(trials, p)] = sum_k (1 - F(k)^count)`` (exact, finite sum)."""
    if trials <= 0 or count <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(trials)
    from scipy.stats import binom

    k = __import__("numpy").arange(trials + 1)
    cdf = binom.cdf(k, trials, p)
    return float((1.0 - cdf ** count).sum())


def omnireduce_layout(n: int, numel: int, *, block_size: int = 256, num_aggregators: int | None = None,
                      channels: int = 2, lanes: int = 16384) -> dict:
    """The block layout of :mod:`sparsecomm.transports.omnireduce` (``wire.plan``), averaged: blocks
    ``nb``, aggregators ``A``, blocks per aggregator ``m``, channels ``G`` per aggregator, channel size
    ``S``, lanes per channel ``L`` and positions per lane ``P = ceil(S / L)``.

    Args:
        n: workers.
        numel: elements of the tensor.
        block_size: elements per block.
        num_aggregators: A (default: one per worker).
        channels: G, channels per aggregator.
        lanes: L, lanes per channel at most.
    """
    A = n if num_aggregators is None else num_aggregators
    nb = math.ceil(numel / block_size)
    m = nb / A
    G = max(1, min(channels, int(m))) if m >= 1 else 1
    S = m / G
    L = max(1, min(lanes, int(S))) if S >= 1 else 1
    P = max(1, math.ceil(S / L))
    return {"nb": nb, "A": A, "m": m, "G": G, "S": S, "L": L, "P": P}


def omnireduce_rounds(n: int, numel: int, union_density: float, **layout_kw) -> list[float]:
    """Expected shape of the stream: for round ``r``, ``(p_r, f_r)`` = the probability that round ``r``
    happens and the expected fraction of the union's blocks it carries.

    Round 0 carries position 0 of every lane (``f_0 = 1/P``; every worker also announces its first
    non-zero block per lane). Round ``r >= 1`` carries one block of every lane holding at least ``r``
    union blocks past position 0: with ``q_r = P(Binomial(P-1, d_u) >= r)``, ``f_r = q_r / (P d_u)``
    and ``p_r = 1 - (1 - q_r)^(A G L)`` (some lane of the ``A G L`` needs it).

    Args:
        n: workers.
        numel: elements of the tensor.
        union_density: d_u, the density of the union's blocks.
        **layout_kw: as for :func:`omnireduce_layout`.
    """
    lay = omnireduce_layout(n, numel, **layout_kw)
    P = lay["P"]
    lanes_total = int(round(lay["A"] * lay["G"] * lay["L"]))
    out = [(1.0, 1.0 / P)]
    if P > 1 and union_density > 0:
        from scipy.stats import binom

        for r in range(1, P):
            q = float(binom.sf(r - 1, P - 1, union_density))
            out.append((1.0 - (1.0 - q) ** lanes_total, q / (P * union_density)))
    return out


def omnireduce_imbalance(n: int, numel: int, density: float, *, block_size: int = 256,
                         num_aggregators: int | None = None, contributors: int = 1) -> float:
    """Expected load of the busiest aggregator relative to the mean, for non-zero blocks at independent
    random positions (balls into bins): ``E[max_a Binomial(c m, d)] / (c m d)`` with ``m`` blocks per
    aggregator and ``c`` independent contributors (1 for the union; ``n`` for the upstream under random
    overlap). Tends to 1 as ``c m d`` grows; large for few non-zero blocks per aggregator.

    Args:
        n: workers.
        numel: elements of the tensor.
        density: d, the non-zero blocks' density.
        block_size: elements per block.
        num_aggregators: A (default: one per worker).
        contributors: c, see above.
    """
    A = n if num_aggregators is None else num_aggregators
    m = math.ceil(numel / block_size) // A
    mean = contributors * m * density
    if mean <= 0 or A <= 1:
        return 1.0
    return _expected_max_binomial(contributors * m, density, A) / mean


def omnireduce_allreduce(n: int, numel: int, *, density: float = 1.0, union_density: float | None = None,
                         overlap: str = "random", elem_size: int = 4, block_size: int = 256,
                         bandwidth_gbps: float = 100.0, latency_us: float = 2.0,
                         deployment: str = "dedicated", num_aggregators: int | None = None,
                         aggregator_bandwidth_gbps: float | None = None, channels: int = 2,
                         lanes: int = 16384, round_fractions: list[float] | None = None,
                         imbalance: tuple[float, float] | None = None,
                         channel_load: tuple[float, float] | None = None) -> Cost:
    """OmniReduce block-sparse all-reduce (Fei, Ho, Sahu, Canini, Sapio, SIGCOMM'21) of ``numel``
    elements whose non-zero blocks have density ``d_w = density`` on each worker.

    Only non-zero blocks travel: each worker sends its own (``d_w nb`` blocks) and receives the union's
    (``d_u nb``; ``d_u = 1 - (1 - d_w)^n`` under ``overlap="random"`` (independent positions, the
    paper's micro-benchmark), ``d_w`` under ``"full"``), each block ``b = block_size * elem_size`` bytes
    plus a 4-byte look-ahead, after the agreement :func:`handshake`; round 0 adds a 224-byte header
    and 4 bytes per lane (1 bit when every
    lane holds one block) each way per aggregator. Per call, with ``A`` aggregators (one per worker
    by default), worker NICs ``B``, aggregator NICs ``B_a``, latency ``alpha``:

    * dedicated: worker up ``U = d_w nb (b+4) + A h0``, down ``D = d_u nb (b+4) + A h0``
      (``h0 = 224 + 4 G L``, or ``224 + G L / 8`` bytes with one block per lane); aggregator in
      ``n U / A``, out ``n D / A``, times the busiest aggregator's excess ``imbalance = (up, down)``
      (:func:`omnireduce_imbalance`; 1 for large tensors):

          T_bw = max(U / B, D / B, imb_up n U / (A B_a), imb_dn n D / (A B_a))

      no factor grows with ``n`` when ``A = n`` and ``B_a = B``: the per-worker bytes depend on the
      densities only.
    * colocated (worker ``a`` hosts aggregator ``a``; its own shard does not cross the wire): each NIC
      carries ``(n-1)/n`` of its upstream plus ``(n-1)`` copies of its shard's downstream, and takes in
      the mirror image: ``T_bw = (n-1)/n (U + imb_dn D) / B`` -- ring's ``2 (n-1)/n`` volume at ``d = 1``.

    Streaming: every channel (``G`` per aggregator, ``L`` lanes fused per message) runs its rounds in
    sequence (a round trip each), and the ``G`` channels of an aggregator overlap each other's up- and
    downstream. Round ``r`` carries a fraction ``f_r`` of the blocks (:func:`omnireduce_rounds`: round 0
    position 0 of every lane, later rounds the lanes with that many union blocks); with
    ``tau_r = f_r T_bw / G`` one channel's share of round ``r`` at the bottleneck NIC,

        T = sum_r max(G tau_r, 2 alpha + 2 tau_r) + max_r tau_r + 2 alpha

    each round is bandwidth-bound (its ``G`` channel-rounds back to back) or latency-bound (one channel's
    round trip); the last term is the pipeline's fill and drain. A channel's rounds cannot overlap each
    other (an aggregator returns a fused round once every holder's message of it has arrived), so the
    busiest channel is a second bound: with ``(k_up, k_dn)`` its blocks in and out at the aggregator
    (``channel_load``; expected: ``n S d_w`` and ``n E[max over A G channels of Binomial(S, d_u)]``),

        T >= R 2 alpha + (k_up (b+4) + k_dn (b+4)) / B_a + 2 alpha

    which dominates when the union's blocks are few and unevenly spread over the channels. Uniform rounds (``d = 1``) give
    ``max(T_bw, 2 alpha R + 2 T_bw / G) + T_bw / (G R) + 2 alpha``. The bandwidth-bound branch assumes
    ``G >= 2 + 2 alpha / tau`` (enough channels in flight to cover a round trip, as the paper's 64 slots
    per thread do). ``round_fractions`` (the ``f_r`` of every round that ran) and ``imbalance`` default to
    their expectations; pass measured values to model one data set.

    Args:
        n: workers.
        numel: elements of the tensor.
        density: d_w, each worker's non-zero blocks' density.
        union_density: d_u (default: from ``overlap``).
        overlap: ``"random"`` or ``"full"``.
        elem_size: bytes per element.
        block_size: elements per block.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        deployment: ``"dedicated"`` aggregators or ``"colocated"`` with the workers.
        num_aggregators: A (default: one per worker).
        aggregator_bandwidth_gbps: B_a (default: ``bandwidth_gbps``).
        channels: G, channels per aggregator.
        lanes: L, lanes per channel at most.
        round_fractions: the measured f_r.
        imbalance: the measured (up, down) excess of the busiest aggregator.
        channel_load: the measured (k_up, k_dn) of the busiest channel.
    """
    if n < 1 or numel <= 0:
        return ZERO
    if overlap not in ("random", "full"):
        raise InvalidValueError(f"overlap must be 'random' or 'full', got {overlap!r}")
    if deployment not in ("dedicated", "colocated"):
        raise InvalidValueError(f"deployment must be 'dedicated' or 'colocated', got {deployment!r}")
    d = float(density)
    du = (1.0 - (1.0 - d) ** n if overlap == "random" else d) if union_density is None else float(union_density)
    B, alpha = link(bandwidth_gbps, latency_us)
    Ba, _ = link(aggregator_bandwidth_gbps if aggregator_bandwidth_gbps is not None else bandwidth_gbps,
                 latency_us)
    A = n if deployment == "colocated" or num_aggregators is None else num_aggregators
    lay = omnireduce_layout(n, numel, block_size=block_size, num_aggregators=A, channels=channels, lanes=lanes)
    nb, G, L = lay["nb"], lay["G"], lay["L"]
    blk = block_size * elem_size + OMNIREDUCE_LOOKAHEAD_BYTES
    # round 0, per (worker, aggregator), each way: the header and a look-ahead per lane (a bit per lane
    # when every lane holds one block: then a look-ahead can only say "position 0" or "none")
    h0 = OMNIREDUCE_HEADER_BYTES + (G * math.ceil(L / 8) if lay["P"] == 1 else 4 * G * L)
    if imbalance is None:
        imb_dn = omnireduce_imbalance(n, numel, du, block_size=block_size, num_aggregators=A)
        c_up = n if overlap == "random" else 1
        imb_up = omnireduce_imbalance(n, numel, d, block_size=block_size, num_aggregators=A, contributors=c_up)
    else:
        imb_up, imb_dn = imbalance
    up_data, dn_data = d * nb * blk, du * nb * blk
    if deployment == "dedicated":
        U, D = up_data + A * h0, dn_data + A * h0
        t_bw = max(U / B, D / B, n * (imb_up * up_data + A * h0) / (A * Ba),
                   n * (imb_dn * dn_data + A * h0) / (A * Ba))
        sent, received = U, D
    else:
        share = (n - 1) / n
        sent = share * (up_data + A * h0) + share * (dn_data + A * h0)
        received = sent
        t_bw = share * (up_data + imb_dn * dn_data + 2 * A * h0) / B
    if round_fractions is None:
        shape = omnireduce_rounds(n, numel, du, block_size=block_size, num_aggregators=A, channels=channels,
                                  lanes=lanes)
    else:
        shape = [(1.0, float(f)) for f in round_fractions]
    taus = [f * t_bw / G for _, f in shape]
    t = sum(p * max(G * tau, 2 * alpha + 2 * tau) for (p, _), tau in zip(shape, taus))
    t += max(taus) + 2 * alpha
    R = sum(p for p, _ in shape)
    if channel_load is None:
        S = max(1, int(lay["S"]))
        k_dn = n * _expected_max_binomial(S, du, int(round(A * G))) if du < 1 else n * S
        k_up = n * S * d if overlap == "random" else k_dn * (d / du if du > 0 else 1.0)
    else:
        k_up, k_dn = channel_load
    chain = 2 * alpha * R + (k_up + k_dn) * blk / (Ba if deployment == "dedicated" else B) + 2 * alpha
    t = max(t, chain)
    msgs = A * (2 + G * (R + 1))
    # first the agreement handshake every transport's workers run (the transport's name, fixed size)
    hs = handshake(n, 1, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
    return add(hs, Cost(t, sent, received, msgs, int(math.ceil(2 * R))))


# ----------------------------------------------------------------------------- sparse switch
SPARSE_SWITCH_HEADER_BYTES = 16     # int32 [W0, slot, pos, next] (sparsecomm/transports/switchml/sparse/dataplane.py)
#: the sparse switch workers' agreement header fields (switch rank, slot_elems, burst, pool_size: as the switch's)
SPARSE_SWITCH_HANDSHAKE_FIELDS = SWITCHML_HANDSHAKE_FIELDS


def sparse_switch_waves(n: int, numel: int, union_density: float, *, slot_elems: int = 256,
                       pool_size: int = 256) -> list[tuple[float, float]]:
    """Expected waves of the sparse switch's stream: wave ``r`` (1-based) carries the ``r``-th union block
    of every lane that has one. Returns ``(p_r, A_r)``: the probability that wave ``r`` happens (some lane
    of ``L`` has ``r`` union blocks) and its expected size ``A_r = L P(Binomial(P, d_u) >= r)`` (``P``
    positions per lane), so that ``sum A_r = L P d_u``, the union's blocks.

    Args:
        n: workers.
        numel: elements of the tensor.
        union_density: d_u, the union's block density.
        slot_elems: elements per block (slot).
        pool_size: slots of the switch's pool.
    """
    nb = math.ceil(numel / slot_elems)
    L = min(pool_size, nb)
    P = math.ceil(nb / L)
    if union_density <= 0:
        return []
    if union_density >= 1:
        return [(1.0, nb / P)] * P
    from scipy.stats import binom

    out = []
    for r in range(1, P + 1):
        q = float(binom.sf(r - 1, P, union_density))
        out.append((1.0 - (1.0 - q) ** L, L * q))
    return out


def sparse_switch_allreduce(n: int, numel: int, *, density: float = 1.0, union_density: float | None = None,
                            overlap: str = "random", slot_elems: int = 256, pool_size: int = 256,
                            bandwidth_gbps: float = 100.0, latency_us: float = 2.0,
                            switch_bandwidth_gbps: float | None = None, switch_latency_us: float | None = None,
                            header_bytes: int = SPARSE_SWITCH_HEADER_BYTES, own_blocks: float | None = None,
                            union_blocks: float | None = None, waves: list[float] | None = None,
                            handshake_fields: int = SPARSE_SWITCH_HANDSHAKE_FIELDS) -> Cost:
    """``sparse-switch`` (OmniReduce's look-ahead on a SwitchML slot pool; ``sparsecomm/transports/
    switchml/sparse/__init__.py``) of ``numel`` int32/fixed-point elements whose ``k``-element blocks are non-zero
    with density ``d_w = density`` on each worker.

    ``nb = ceil(numel / k)`` blocks in ``L = min(pool_size, nb)`` lanes of ``P = ceil(nb / L)`` positions;
    the union has ``R = d_u nb`` blocks (``d_u = 1 - (1 - d_w)^n`` under ``overlap="random"``, ``d_w``
    under ``"full"``), a worker owns ``o = d_w nb``. A value packet is ``b = h + 4k`` bytes, a skip
    ``h``; with ``tau = b / min(B, B_s)`` and ``RTT = alpha + alpha_s + 2 tau``:

        bytes up   = b (control) + P_la b (look-ahead round, P_la = ceil((L+1)/k)) + o b + (R - o) h
        bytes down = b + P_la b + R b
        T = RTT + (RTT + (P_la - 1) tau) + (A_1 - 1) tau + sum_{r >= 2} p_r max(A_r tau, RTT) + RTT

    the control and look-ahead round trips, then the stream as *waves*: wave ``r`` carries the ``r``-th
    union block of every lane that has one (``A_r`` packets, :func:`sparse_switch_waves`; ``p_r`` the
    probability that it happens). A lane's next block leaves only when its previous result is back, so
    wave 1 leaves back to back, and every later wave's last packet leaves a round trip after its lane's
    previous one, unless the wave's ``A_r`` packets take longer to serialise through a port (then the
    stream is bandwidth-bound, ``sum A_r tau = R tau``); the last result is back a round trip after
    the last packet leaves. Few lanes with many union blocks each is
    pool pressure: ``P d_u`` waves of one round trip each (SwitchML's ``pool * b / RTT`` throughput
    limit when ``d_u = 1``). Nothing depends on ``n`` beyond ``d_u`` and, before the control packet, the
    agreement header the workers exchange among themselves (:func:`handshake`: ``ceil(log2 n)`` small
    messages, so that a worker running another transport is told so). ``own_blocks``, ``union_blocks``
    and ``waves`` (the measured ``A_r``, each wave then certain) override the expectations.

    Args:
        n: workers.
        numel: elements of the tensor.
        density: d_w.
        union_density: d_u (default: from ``overlap``).
        overlap: ``"random"`` or ``"full"``.
        slot_elems: k, elements per block.
        pool_size: slots of the switch's pool.
        bandwidth_gbps: each worker NIC's rate, Gbit/s (:func:`link`).
        latency_us: each message's latency, microseconds (:func:`link`).
        switch_bandwidth_gbps: the switch ports' rate, Gbit/s (default: ``bandwidth_gbps``).
        switch_latency_us: the switch's latency, microseconds (default: ``latency_us``).
        header_bytes: bytes of each packet's header.
        own_blocks: see above.
        union_blocks: see above.
        waves: see above.
        handshake_fields: int64 fields of the transport's agreement header (:func:`handshake`).
    """
    if n < 1 or numel <= 0:
        return ZERO
    if overlap not in ("random", "full"):
        raise InvalidValueError(f"overlap must be 'random' or 'full', got {overlap!r}")
    B, alpha = link(bandwidth_gbps, latency_us)
    Bs, alpha_s = link(switch_bandwidth_gbps if switch_bandwidth_gbps is not None else bandwidth_gbps,
                       switch_latency_us if switch_latency_us is not None else latency_us)
    k = slot_elems
    nb = math.ceil(numel / k)
    L = min(pool_size, nb)
    d = float(density)
    du = (1.0 - (1.0 - d) ** n if overlap == "random" else d) if union_density is None else float(union_density)
    o = d * nb if own_blocks is None else float(own_blocks)
    R = du * nb if union_blocks is None else float(union_blocks)
    shape = (sparse_switch_waves(n, numel, du, slot_elems=k, pool_size=pool_size) if waves is None
             else [(1.0, float(a)) for a in waves if a > 0])
    b = header_bytes + 4 * k
    tau = b / min(B, Bs)
    rtt = alpha + alpha_s + 2 * tau
    p_la = math.ceil((L + 1) / k)
    t = rtt + rtt + (p_la - 1) * tau
    if R > 0 and shape:
        # wave 1 leaves back to back; a later wave's last packet leaves a round trip after its lane's
        # previous one, or once the wave has been serialised; the last result is back a round trip later
        t += max(shape[0][1] - 1, 0) * tau + sum(p * max(a * tau, rtt) for p, a in shape[1:]) + rtt
    sent = b + p_la * b + o * b + (R - o) * header_bytes
    received = b + p_la * b + R * b
    steps = 2 + (int(math.ceil(sum(p for p, _ in shape))) + 1 if R > 0 else 0)
    return add(handshake(n, handshake_fields, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us),
               Cost(t, sent, received, 1 + p_la + R, steps))


#: the cost model of every registered transport, by its registry name (one entry per transport:
#: ``tests/repo/test_registration.py`` fails for a registered transport without one)
MODELS = {
    "ring": ring_allreduce,
    "native": native_allreduce,
    "allgather": allgather,
    "omnireduce": omnireduce_allreduce,
    "switch": switchml_allreduce,
    "sparse-switch": sparse_switch_allreduce,
}
