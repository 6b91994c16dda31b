"""``powersgd``: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical low-rank gradient compression for
distributed optimization", NeurIPS 2019 (the algorithm as torch's ``powerSGD_hook`` runs it).

Each tensor of the bucket is viewed as an n x m matrix M = (grad + e)_j (``theory.powersgd_matrix``);
those worth it (``theory.powersgd_compresses``: (n+m) r * min_compression_rate < n m) get rank
r = min(n, m, matrix_approximation_rank), the others travel whole. Two aggregation rounds per step::

    round 1: send [uncompressed tensors, P_j = M_j Q_j]          Q_j: warm start (last step's mean Q,
    round 2: P^_j = orth(sum_w P_j);  send Q_j = M_j^T P^_j              orthonormalised) or Gaussian
    estimate: uncompressed -> their mean,  M_j -> P^_j (sum_w Q_j / n)^T
    error feedback: e <- (grad + e) - estimate;   warm start: Q_j <- sum_w Q_j / n

The estimate is P^ P^^T mean_w M_w, a projection of the mean (linear in the workers' matrices, hence
summable by every transport as dense payloads). Q is drawn from the pipeline's generator, shared by
every worker (``shared_randomness``), matrix by matrix in torch's order, bucket by bucket: seeded alike,
this method and ``powerSGD_hook`` follow the same trajectory to float rounding
(tests/methods/test_methods_powersgd.py). The keywords are torch's ``PowerSGDState``'s
(``matrix_approximation_rank``, ``start_powerSGD_iter``, ``min_compression_rate``,
``use_error_feedback``, ``warm_start``, and ``orthogonalization_epsilon``, ``batch_tensors_with_same_shape``,
``compression_stats_logging_frequency``), so moving from ``powerSGD_hook`` to
``sparsecomm.ddp.register(model, compressor="powersgd", ...)`` keeps them. Of the last three, none changes
the numbers here: the reduced QR needs no epsilon (torch adds it to a column's norm only to avoid dividing
by zero; a zero matrix still gets an orthonormal basis here, and torch agrees to O(epsilon) when it is
given), the matrices are processed one by one (torch's batching is a speed option), and
``compression_stats()`` reports the bytes at any time (torch logs them every that many iterations).
**Parity with torch's hook** (tests/methods/test_methods_powersgd.py): torch draws a fresh Q with
``torch.manual_seed(state.rng.randint(1_000_000_000))``, ``state.rng = numpy.random.RandomState(random_seed)``;
this method draws from the generator the pipeline passes, shared by every worker and seeded with the
frontend's ``seed=`` (the default, ``random_seed=None``). Given torch's ``random_seed``, it draws every
fresh Q from a generator on the bucket's device seeded with the integer torch's rng draws first,
``numpy.random.RandomState(random_seed).randint(1_000_000_000)``; on CPU that is torch's draw for a model
of one bucket with ``warm_start=True`` (torch draws a new integer for each further bucket and, without
warm start, each step; here they all start from that one). Equivalently, ``seed=`` that integer with
``random_seed=None`` (how tests/methods/test_methods_powersgd.py pins torch's ``state.rng``). The other
keywords that change numbers must match too: ``matrix_approximation_rank``, ``start_powerSGD_iter``,
``min_compression_rate``, ``use_error_feedback``, ``warm_start``. ``start_powerSGD_iter``:
the steps ``0 .. start_powerSGD_iter - 1`` of the optimizer or the DDP hook are exact rounds (plain
averaging, error flushed), as torch counts its iterations (the rounds of a
:class:`~sparsecomm.methods.state.MethodState` count the frontend's steps); the optimizer's and the
DDP hook's ``warmup_steps`` do the same for every method.

**State and resume.** A bucket's state is the error (per coordinate) and the warm-start Q (m_j r_j
values per compressed matrix, r_j from the matrix's shape and the hyper-parameters): it splits into
one piece per tensor (:meth:`PowerSGD.state_sizes`), so the DDP hook remaps it exactly onto another
bucket layout. A resume is bit-exact (given a transport whose sum does not depend on the layout) unless
fresh Qs are drawn on a layout other than the uninterrupted run's: under the DDP hook that is the
case with ``warm_start=False`` (fresh Qs every step) or when the first iteration after the restore,
which has DDP's initial bucket layout, is the first compressed step; :mod:`sparsecomm.ddp` states the
exact cases. Under :class:`~sparsecomm.DistributedOptimizer` the layout is fixed and a resume is
always bit-exact. Every product and QR takes its matrices at a fixed memory alignment (:func:`_aligned`),
so that its rounding does not depend on a matrix's offset in the bucket, which follows the layout: a
compressed matrix at an unaligned offset has its residual written into an aligned buffer that the bucket's
steps reuse (``MethodState.scratch``), and a product whose place in the estimate is unaligned is computed
into another and copied (in the pass that updates the error).

Orthogonalisation is a reduced QR (sign conventions cancel in P^ P^^T; a zero sum still yields an
orthonormal basis, never NaN), in float32 for bfloat16/float16 buckets (the bases are rounded back to
the bucket's dtype).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from ..compressors.lowrank import LowRank, need_generator
from ..payload import Payload
from ..compressors._common import add_finite, copy_sub
from .base import Method, check_finite, dense_payload, raise_input_nonfinite
from ..errors import InvalidValueError


#: PowerSGD's compressed input, as its NonFiniteError names it (error feedback on)
_FORMED = "M = g + e (the gradient plus the error-feedback residual)"


@dataclass
class PowerSGDState:
    """Per-bucket state: the error ``e`` (bucket length) and the warm-start ``q`` (all Q_j, m_j r_j
    values each, in the order of the bucket's compressed matrices; ``None`` before the first compressed
    step). (``step``: accepted from older checkpoints and ignored; the start rule counts the rounds of
    the :class:`~sparsecomm.methods.state.MethodState`.)"""

    error: torch.Tensor
    q: torch.Tensor | None
    step: InitVar[int | None] = None


class PowerSGD(Method):
    """``get("powersgd", matrix_approximation_rank=1, start_powerSGD_iter=0, min_compression_rate=2,
    use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0, batch_tensors_with_same_shape=False,
    compression_stats_logging_frequency=10000, random_seed=None)``: the keywords of torch's ``PowerSGDState``,
    with the same meaning (see the module doc; without ``random_seed`` the frontend's ``seed=`` seeds the Qs)."""

    name, uses_shapes, multi_round, State = "powersgd", True, True, PowerSGDState
    #: the error-feedback sum (or the gradient) is checked in the pass that forms it, before any state changes
    checks_input = True

    def __init__(self, matrix_approximation_rank: int = 1, *, start_powerSGD_iter: int = 0,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 batch_tensors_with_same_shape: bool = False,
                 compression_stats_logging_frequency: int = 10_000, random_seed: int | None = None) -> None:
        if int(matrix_approximation_rank) < 1 or start_powerSGD_iter < 0 or min_compression_rate < 0:
            raise InvalidValueError("powersgd: matrix_approximation_rank >= 1, start_powerSGD_iter >= 0 and "
                                    "min_compression_rate >= 0")
        if not orthogonalization_epsilon >= 0 or int(compression_stats_logging_frequency) < 1:
            raise InvalidValueError(f"powersgd: orthogonalization_epsilon >= 0 and "
                                    f"compression_stats_logging_frequency >= 1 (got {orthogonalization_epsilon!r}, "
                                    f"{compression_stats_logging_frequency!r})")
        #: torch's keywords, accepted so that a ``PowerSGDState`` moves over by name (see the module doc)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.compression_stats_logging_frequency = int(compression_stats_logging_frequency)
        if random_seed is not None and (isinstance(random_seed, bool) or not isinstance(random_seed, int)
                                        or not 0 <= random_seed < 2 ** 32):
            raise InvalidValueError(f"powersgd: random_seed must be an integer in [0, 2**32) or None, "
                                    f"got {random_seed!r}")
        self.random_seed = random_seed
        #: the seed torch's hook draws its first bucket's Qs with, ``RandomState(random_seed).randint(10**9)``
        self._q_seed = None if random_seed is None else int(np.random.RandomState(random_seed).randint(1_000_000_000))
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback, self.warm_start = bool(use_error_feedback), bool(warm_start)
        super().__init__(LowRank(self.matrix_approximation_rank))

    def hyper(self):
        seeded = {} if self.random_seed is None else {"random_seed": self.random_seed}
        return {"matrix_approximation_rank": self.matrix_approximation_rank,
                "start_powerSGD_iter": self.start_powerSGD_iter, "min_compression_rate": self.min_compression_rate,
                "use_error_feedback": self.use_error_feedback, "warm_start": self.warm_start, **seeded}

    def encode(self, grad, state, generator=None, **kw):
        """:meth:`Method.encode`; with ``random_seed``, fresh Qs come from a generator seeded as torch's hook
        seeds its first bucket's (see the module doc), not from ``generator``."""
        if self._q_seed is not None:
            generator = torch.Generator(device=grad.device).manual_seed(self._q_seed)
        return super().encode(grad, state, generator, **kw)

    def state_sizes(self, shapes):
        """The error is per coordinate; the warm-start ``q`` holds m_j r_j values per compressed
        matrix, none for a tensor sent whole."""
        return {"q": [m * r for _, _, _, m, r in self._layout(shapes)]}

    def _layout(self, shapes):
        """(offset, numel, n, m, r) of every tensor; r = 0 for those sent whole."""
        out, off = [], 0
        for s in shapes:
            n, m = th.powersgd_matrix(s)
            rank = self.matrix_approximation_rank
            r = min(n, m, rank) if th.powersgd_compresses(n, m, rank, self.min_compression_rate) else 0
            out.append((off, n * m, n, m, r))
            off += n * m
        return out

    def _exact_round(self, ms, exact: bool) -> bool:
        """Whether an encode with ``ms`` sends the bucket uncompressed: an exact round, or a step before
        ``start_powerSGD_iter`` (what :meth:`_encode` does and :meth:`work` prices)."""
        return exact or ms.rounds < self.start_powerSGD_iter

    def work(self, phase, state, d, *, exact=False, shapes=None):
        """Per compressed matrix (n x m, rank r): encode ``M Q`` (``matmul``, n m r) and a QR; the P round
        ``M^T P`` (``matmul_t``) and a QR; decode ``P Q^T`` (``matmul_outer``: the n x m estimate written, a
        kernel of its own); and the passes over the bucket (the
        residual added and checked in one pass, or only checked without error feedback; the residual subtracted;
        the whole tensors' copies and division; an exact round's error cleared). A matrix at an unaligned place
        in the bucket (its residual in an aligned copy, :class:`_Plan`) has its estimate written into the aligned
        product buffer and then into the estimate: one more pass over it in the decode (the bucket and the estimate
        start aligned, as torch allocates them, so the matrix's place is unaligned in both or in neither)."""
        ef = d if self.use_error_feedback else 0
        pend = state.pending
        if phase == "encode":
            if self._exact_round(state, exact):
                return {"elementwise": 2 * d, "kernel": 1}
            lay = self._layout(tuple(map(torch.Size, shapes)) if shapes is not None else state.shapes_of(d))
        elif pend is not None and pend[0] in ("P", "Q"):
            lay = pend[2]
        else:
            return {"elementwise": d, "kernel": 1} if phase == "decode" else {"kernel": 1}   # exact: the division
        comp = [(n, m, r) for _, _, n, m, r in lay if r]
        unc = sum(k for _, k, _, _, r in lay if r == 0)
        macs = sum(n * m * r for n, m, r in comp)
        if phase == "encode":
            return {"elementwise": d + unc + sum(n * r for n, _, r in comp), "matmul": macs,
                    "kernel": 1 + len(comp)}
        if phase == "next_round":
            if pend[0] != "P" or not comp:
                return {"kernel": 1}
            return {"elementwise": unc + sum(m * r for _, m, r in comp), "matmul_t": macs, "kernel": 1 + len(comp)}
        if pend[0] == "P":
            return {"elementwise": d + ef, "kernel": 1}
        moved = sum(k for (_, k, _, _, _), copy in pend[1].comp if copy is not None)
        return {"elementwise": unc + sum(m * r for _, m, r in comp) + ef + moved, "matmul_outer": macs,
                "kernel": 1 + len(comp)}

    def init_state(self, d, dtype, device):
        return PowerSGDState(torch.zeros(d, dtype=dtype, device=device), None)

    def _encode(self, grad, ms, generator, exact, world_size):
        st, ef = ms.state, self.use_error_feedback
        if self._exact_round(ms, exact):
            if ef:                          # grad + e, added and checked in one pass
                if not add_finite(grad, st.error, grad):
                    raise_input_nonfinite(self.name, _FORMED)
            else:
                check_finite(grad, self.name)
            st.error.zero_()
            ms.pending = ("exact",)
            return dense_payload(grad)
        plan = _Plan.of(ms, grad, self._layout)
        lay = plan.lay
        if ef:      # M = grad + e (added and checked in one pass): in place, except the matrices at unaligned
            #         offsets, written into their aligned copies
            ok = True
            for o, k, copy in plan.pieces:
                part = grad[o:o + k]
                ok = add_finite(part, st.error[o:o + k], part if copy is None else copy) and ok
            if not ok:
                raise_input_nonfinite(self.name, _FORMED)
        else:
            check_finite(grad, self.name)
            for o, k, copy in plan.pieces:
                if copy is not None:
                    copy.copy_(grad[o:o + k])
        mats = [grad[o:o + k].view(n, m) if c is None else c.view(n, m) for (o, k, n, m, _), c in plan.comp]
        nq = plan.nq
        if st.q is None or not self.warm_start or st.q.numel() != nq:
            st.q = _gaussian_q(lay, need_generator(generator), grad)
        parts, qoff = [grad[o:o + k] for (o, k), _ in plan.whole], 0
        for (o, k, n, m, r), x in zip(plan.comp_lay, mats):
            q = orthonormal(_aligned(st.q[qoff:qoff + m * r].view(m, r)))
            parts.append(factor_product(x, q).reshape(-1))
            qoff += m * r
        ms.pending = ("P", plan, lay, grad, mats)
        return _dense(torch.cat(parts) if parts else grad[:0])

    def _next_round(self, aggregate, world_size, ms):
        pend = ms.pending
        if pend[0] != "P" or not pend[1].comp_lay:
            return None
        _, plan, lay, mat, mats = pend
        unc = plan.unc
        pos, ps, qs = unc, [], []
        for (o, k, n, m, r), x in zip(plan.comp_lay, mats):
            p = orthonormal(_aligned(aggregate[pos:pos + n * r].view(n, r)))
            ps.append(p)
            qs.append(factor_product(x, p, transpose=True).reshape(-1))
            pos += n * r
        ms.pending = ("Q", plan, lay, mat, mats, aggregate[:unc].clone(), ps)   # the sums of the whole tensors
        return _dense(torch.cat(qs))

    def _decode(self, aggregate, world_size, ms, out):
        pend, st = ms.take_pending(self.name), ms.state
        if pend[0] == "exact":
            torch.div(aggregate, world_size, out=out)
            return
        plan, mat, ef, err = pend[1], pend[3], self.use_error_feedback, st.error
        if pend[0] == "P":                               # nothing compressed: one round
            torch.div(aggregate, world_size, out=out)
            if ef:
                torch.sub(mat, out, out=err)
            return
        mats, unc, ps, qmean, j = pend[4], pend[5], pend[6], aggregate / world_size, 0
        for (o, k), u in plan.whole:
            torch.div(unc[u:u + k], world_size, out=out[o:o + k])
        for ((o, k, n, m, r), _), p, x in zip(plan.comp, ps, mats):
            q, dst = _aligned(qmean[j:j + m * r].view(m, r)), out[o:o + k]
            if dst.data_ptr() % _ALIGN == 0:             # the product written where it goes, e <- M - estimate
                outer_product(p, q, dst.view(n, m))
                if ef:
                    torch.sub(x.view(-1), dst, out=err[o:o + k])
            else:                                        # into an aligned buffer, then copied (and e) in one pass
                prod = outer_product(p, q, plan.product(k).view(n, m)).view(-1)
                if ef:
                    copy_sub(prod, x.view(-1), dst, err[o:o + k])
                else:
                    dst.copy_(prod)
            j += m * r
        st.q = qmean
        if ef:
            for (o, k), _ in plan.whole:
                torch.sub(mat[o:o + k], out[o:o + k], out=err[o:o + k])


#: the address alignment (bytes) of every matrix a product or a QR reads or writes: a fresh tensor's
#: (torch's CPU allocator aligns to 64 bytes, its CUDA caching allocator to 512). A BLAS kernel may round
#: differently for a matrix at another address (MKL's gemm does for rows that are not 16-byte aligned),
#: and a tensor's offset in the flat bucket follows the bucket layout, which DDP rebuilds after its first
#: iteration (and a restored process starts from its initial one).
_ALIGN = 64


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) if its data is :data:`_ALIGN`-byte aligned, else an aligned copy with the same
    strides: a product's rounding then does not depend on where ``x`` sits in its bucket."""
    return x if x.data_ptr() % _ALIGN == 0 else x.clone()


def factor_product(x: torch.Tensor, f: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``x @ f`` (``transpose``: ``x^T @ f``) for a tall factor ``f`` of r columns, computed as the transpose of
    ``f^T @ x^T`` (``f^T @ x``): the product with the r-row factor on the left, as one contiguous pass over
    ``x``'s rows. On one thread a BLAS gemm of a transposed n x m matrix by a skinny factor can be 10-25x
    slower (MKL: 12 ms against 0.5 ms for 1024 x 1024 by 1024 x 4); the result is the same product, each
    element the same dot product, summed in the kernel's own order."""
    prod = torch.mm(f.T, x) if transpose else torch.mm(f.T, x.T)
    return prod.T


def outer_product(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``p @ q^T`` (n x r by m x r: the n x m estimate ``P Q^T``) written into ``out`` (n x m) and returned: the
    decode's product, which writes the large matrix where :func:`factor_product`'s read it (a kernel of its own
    on the host model: ``matmul_outer``)."""
    return torch.mm(p, q.T, out=out)


def _aligned_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` zeros whose data is :data:`_ALIGN`-byte aligned (whatever the allocator's alignment)."""
    raw = torch.zeros(n + _ALIGN, dtype=dtype, device=device)
    skip = (-raw.data_ptr() % _ALIGN) // raw.element_size()
    return raw[skip:skip + n]


class _Plan:
    """Where a bucket's compressed steps keep their matrices (in ``MethodState.scratch``, reused while the
    shapes, the dtype, the device and the bucket's address modulo :data:`_ALIGN` stay the same).

    ``lay``: :meth:`PowerSGD._layout`. ``pieces``: (offset, numel, copy), the bucket in order: a compressed
    matrix at an unaligned offset is a piece of its own whose ``copy`` is an aligned buffer (its residual
    M = grad + e is written there and every product reads it there); the rest is residual in place in the
    bucket (``copy`` ``None``; consecutive tensors one piece). ``comp``: (layout entry, copy) of each
    compressed matrix. ``whole``: ((offset, numel), offset in the message) of each run of consecutive tensors
    sent whole. :meth:`product`: the decode's aligned buffer for a product whose place in the estimate is
    not aligned."""

    def __init__(self, key, lay, like: torch.Tensor) -> None:
        self.key, self.lay, es = key, lay, like.element_size()
        self.pieces, self.comp, self.whole = [], [], []
        base, u = like.data_ptr(), 0
        for o, k, n, m, r in lay:
            copy = _aligned_zeros(k, like.dtype, like.device) if r and (base + o * es) % _ALIGN else None
            if copy is None and self.pieces and self.pieces[-1][2] is None:
                po, pk, _ = self.pieces[-1]
                self.pieces[-1] = (po, pk + k, None)
            else:
                self.pieces.append((o, k, copy))
            if r:
                self.comp.append(((o, k, n, m, r), copy))
                continue
            if self.whole and sum(self.whole[-1][0]) == o:
                (wo, wk), wu = self.whole[-1]
                self.whole[-1] = ((wo, wk + k), wu)
            else:
                self.whole.append(((o, k), u))
            u += k
        self._largest = max([k for _, k, _, _, r in lay if r], default=0)
        #: the layout entries of the compressed matrices; the Qs' length; the elements sent whole
        self.comp_lay = [t for t in lay if t[4]]
        self.nq = sum(m * r for _, _, _, m, r in lay)
        self.unc = sum(k for _, k, _, _, r in lay if r == 0)
        self._dtype, self._device, self._prod = like.dtype, like.device, None

    @classmethod
    def of(cls, ms, grad: torch.Tensor, layout) -> "_Plan":
        """``ms.scratch`` when it was built for ``grad``'s shapes, dtype, device and address modulo
        :data:`_ALIGN`, else a new plan (kept there) of the layout ``layout(shapes)``."""
        shapes = ms.shapes_of(grad.numel())
        key = (shapes, grad.dtype, grad.device, grad.data_ptr() % _ALIGN)
        plan = ms.scratch
        if not isinstance(plan, cls) or plan.key != key:
            plan = ms.scratch = cls(key, layout(shapes), grad)
        return plan

    def product(self, k: int) -> torch.Tensor:
        """An aligned buffer of ``k`` elements (at most the largest compressed matrix's) for a product."""
        if self._prod is None:
            self._prod = _aligned_zeros(self._largest, self._dtype, self._device)
        return self._prod[:k]


def orthonormal(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``x``'s columns (reduced QR's Q), in ``x``'s dtype. Half-precision
    inputs (bfloat16, float16: no QR kernel on CPU, and too few bits for Householder reflections)
    are orthogonalised in float32 and the basis rounded back."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(x.float()).Q.to(x.dtype)
    return torch.linalg.qr(x).Q


def _dense(x: torch.Tensor) -> Payload:
    return Payload("dense", x, x.shape, x.dtype, bits=8 * x.numel() * x.element_size())


def _gaussian_q(lay, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Fresh Q_j ~ N(0, 1) (m x r each, concatenated in layout order), drawn matrix by matrix with the
    matrices grouped by shape in order of first appearance: the order of torch's ``powerSGD_hook``, so
    that a generator seeded as its ``state.rng`` dictates draws the same starting Qs."""
    comp = [(n, m, r) for _, _, n, m, r in lay if r]
    first: dict = {}
    for j, (n, m, _) in enumerate(comp):
        first.setdefault((n, m), j)
    draws = {}
    for j in sorted(range(len(comp)), key=lambda j: first[comp[j][:2]]):
        draws[j] = torch.randn(comp[j][1] * comp[j][2], generator=generator, dtype=like.dtype, device=like.device)
    return torch.cat([draws[j] for j in range(len(comp))]) if comp else like.new_empty(0)
