"""SwitchML worker side: what each packet of a job carries, and what each result gives back.

A float job (Sapio et al., NSDI'21, Sec. 5.3; the p4app-switchML client's exponent quantizer) streams
``P = M + L`` packets for ``M`` chunks of ``E`` elements over ``L`` lanes: packet ``p`` carries chunk
``p``'s exponent (``p < M``) and chunk ``p - L``'s codes (``p >= L``), so each chunk's scale
``f = (INT32_MAX / n - 1) / 2^e`` (:func:`sparsecomm.codec.scale_from_exponents`, ``e`` the maximum over
workers that the switch returns) is known one lane window before its codes are sent. Codes are
``q = round(x f)`` (half away from zero, the product in float64: :func:`sparsecomm.codec.to_fixed`'s rule)
and the result is ``sum_w q_w / f`` in the job's working precision (:func:`sparsecomm.codec.from_fixed`'s
rule), bit for bit; both run as one compiled call per message (:func:`_encode`, :func:`_decode`). The first
``L`` packets carry no codes: on real fabrics their rows are ``HEADER`` words wide (header-only packets,
:mod:`.dataplane`; a SimFabric with a host model's real-fabric messages too), on SimFabric's own datagrams whole
rows of zeros; the encoder and the decoder take either.
Stochastic rounding goes through :func:`sparsecomm.codec.to_fixed` chunk by chunk (each chunk keeps its
position in the rounding stream). An integer job ("bypass") sends its int32 values as they are.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ... import codec
from ...errors import OverflowError_, ProtocolError
from .dataplane import EXP_MAX, EXP_MIN, F_EXP, HEADER


@njit(cache=True, nogil=True)
def _encode(x, E, M, pre, pkts, e_loc, scales, table, rows):  # pragma: no cover - numba
    """Fill the payload of ``rows[k]``, packet ``p = pkts[k]``: chunk ``p``'s exponent (``p < M``) and
    chunk ``c = p - pre``'s codes ``round(x[chunk c] * scales[c])`` (``p >= pre``; half away from zero,
    float64 product; past the end of ``x``, and before ``pre``, zeros). Returns -1 or the index of the
    first element whose code leaves int32 (checked per chunk, so that the element loop vectorises).

    No code can leave int32 when the agreed scale is at most the one of the chunk's own exponent
    (``scales[c] <= table[e_loc[c] - EXP_MIN]``, i.e. the agreed exponent is at least the local one:
    ``|x| < 2^e_loc`` gives ``|x f| < Q / n - 1``, :func:`sparsecomm.codec.scale_from_exponents`); such
    a chunk is encoded without the range check (the same codes, a loop without the check's work); only a
    smaller agreed exponent (a forged result) takes the checked loop."""
    N = x.size
    for k in range(pkts.size):
        p = pkts[k]
        rows[k, 7] = e_loc[p] if p < M else EXP_MIN
        row = rows[k, 8:]
        if p < pre:                          # exponent-only packets carry zeros
            row[:] = 0
            continue
        c = p - pre
        s = scales[c]
        base = c * E
        xs = x[base:min(base + E, N)]
        ec = e_loc[c] - EXP_MIN
        if 0 <= ec < table.size and s <= table[ec]:
            for j in range(xs.size):
                v = np.float64(xs[j]) * s
                t = np.trunc(v)
                d = v - t
                t += np.float64(d >= 0.5) - np.float64(d <= -0.5)
                row[j] = np.int32(t)
            row[xs.size:] = 0
            continue
        ok = True
        for j in range(xs.size):
            v = np.float64(xs[j]) * s
            t = np.trunc(v)
            d = v - t
            t += np.float64(d >= 0.5) - np.float64(d <= -0.5)
            ok &= (t >= -2147483648.0) & (t <= 2147483647.0)
            row[j] = np.int32(t)
        row[xs.size:] = 0
        if not ok:
            for j in range(xs.size):
                t = np.trunc(np.float64(xs[j]) * s)
                if not (np.abs(t) <= 2147483648.0):
                    return base + j
            return base
    return -1


@njit(cache=True, nogil=True)
def _decode(rows, pkts, M, pre, table, exponents, scales, sums, keep, out):  # pragma: no cover - numba
    """The results ``rows[k]`` of packets ``p = pkts[k]``: chunk ``p``'s agreed exponent and scale
    (``p < M``; ``scales = table[e - EXP_MIN]``), and chunk ``c = p - pre``'s sums (``p >= pre``):
    ``out[chunk c] = rows[k, HEADER:] / scales[c]`` (float64 quotient, rounded once to ``out``'s dtype;
    ``out`` may end inside the last chunk), and with ``keep`` also ``sums[chunk c] = rows[k, HEADER:]``
    (otherwise ``sums`` is not touched). Returns -1, or the first packet whose exponent no int8 register
    holds (a forged result; the rows before it are taken)."""
    N = out.size
    E = rows.shape[1] - 8
    for k in range(pkts.size):
        p = pkts[k]
        if p < M:
            e = np.int64(rows[k, 7])
            if e < EXP_MIN or e > EXP_MAX:
                return p
            exponents[p] = e
            scales[p] = table[e - EXP_MIN]
        if p < pre:
            continue
        c = p - pre
        s = scales[c]
        base = c * E
        row = rows[k, 8:]
        if keep:
            sums[base:base + E] = row
        o = out[base:min(base + E, N)]
        for j in range(o.size):
            o[j] = np.float64(row[j]) / s
    return -1


_tables: dict[int, np.ndarray] = {}


def scale_table(n: int) -> np.ndarray:
    """``scale_from_exponents(e, n)`` for every int8 exponent ``e`` (index ``e - EXP_MIN``)."""
    t = _tables.get(n)
    if t is None:
        e = torch.arange(EXP_MIN, EXP_MAX + 1, dtype=torch.int64)
        t = _tables[n] = codec.scale_from_exponents(e, n).numpy()
    return t


class FloatJob:
    """Encoder / decoder of one float job's packets (see the module docstring): the flat input ``x``, the
    result ``out`` (may be ``x`` itself: each chunk is encoded before its result arrives), the int32
    ``sums`` (``M E`` of them; ``None``: not kept, which saves a write of the sums per job), the local
    exponents ``e_loc`` and ``lanes``, ``n`` workers."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, sums: torch.Tensor | None, e_loc: np.ndarray, E: int,
                 lanes: int, n: int, seed: int | None) -> None:
        self.x, self.xnp, self.onp = x, x.numpy(), out.numpy()
        self.keep = sums is not None
        self.snp = sums.numpy() if sums is not None else np.zeros(0, dtype=np.int32)
        self.e_loc, self.seed, self.E = e_loc, seed, E
        M = -(-x.numel() // E)
        self.M, self.pre = M, lanes
        self.packets = M + lanes
        self.exponents = np.full(M, EXP_MIN, dtype=np.int64)
        self.scales = np.zeros(M, dtype=np.float64)
        self.table = scale_table(n)

    def payload(self, pkts: np.ndarray, rows: np.ndarray) -> None:
        M, pre, E = self.M, self.pre, self.E
        if self.seed is None:
            bad = _encode(self.xnp, E, M, pre, pkts, self.e_loc, self.scales, self.table, rows)
            if bad >= 0:
                raise OverflowError_(f"switch allreduce: element {bad} = {float(self.xnp[bad])!r} times its "
                                     f"chunk's agreed scale {self.scales[bad // E]!r} leaves int32")
            return
        rows[:, F_EXP] = np.where(pkts < M, self.e_loc[np.minimum(pkts, M - 1)], EXP_MIN)
        for r, p in enumerate(pkts.tolist()):
            if p < pre:                                     # exponent-only packets carry zeros
                rows[r, HEADER:] = 0
                continue
            c = p - pre
            chunk = self.x[c * E:(c + 1) * E]
            codes = codec.to_fixed(chunk, float(self.scales[c]), chunk=E, rounding="stochastic",
                                   seed=self.seed, offset=c * E).numpy()
            rows[r, HEADER:HEADER + len(codes)] = codes
            rows[r, HEADER + len(codes):] = 0

    def consume(self, pkts: np.ndarray, rows: np.ndarray) -> None:
        bad = _decode(rows, pkts, self.M, self.pre, self.table, self.exponents, self.scales, self.snp, self.keep,
                      self.onp)
        if bad >= 0:
            raise ProtocolError(f"switch allreduce: the result of packet {bad} carries an exponent outside "
                                f"[{EXP_MIN}, {EXP_MAX}] (forged or corrupted packet)")


class IntJob:
    """Encoder / decoder of an integer ("bypass") job: int32 values as they are, one chunk per packet."""

    #: packets before this one carry no values (none: every packet carries its chunk)
    pre = 0

    def __init__(self, v2d: torch.Tensor) -> None:
        self.xnp = v2d.numpy()
        self.packets = self.M = v2d.shape[0]
        self.sums = np.zeros(v2d.shape, dtype=np.int32)

    def payload(self, pkts: np.ndarray, rows: np.ndarray) -> None:
        rows[:, HEADER:] = self.xnp[pkts]

    def consume(self, pkts: np.ndarray, rows: np.ndarray) -> None:
        self.sums[pkts] = rows[:, HEADER:]
