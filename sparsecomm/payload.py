"""What a compressor produces and a transport carries.

A payload's *kind* decides which transports can sum it (the table of kinds x transports in docs/transports.md):

``dense``
    ``values`` is the whole flat tensor (possibly in a narrower float dtype, possibly with zero blocks).
``aligned``
    ``values`` sit at ``indices`` that every worker agrees on (shared-seed rand-k); only the values
    travel, so the sum is the element-wise sum of the value vectors.
``sparse``
    ``(indices, values)`` at worker-specific positions (top-k); summed by gathering or block encoding.
    A *row-sparse* payload (``bucket_size = b`` set on a ``sparse`` one) has one index per row of ``b``
    consecutive elements and ``b`` values per index (an embedding's gradient rows: ``index * b + j``);
    only :meth:`AllGather.gather <sparsecomm.transports.allgather.AllGather.gather>` carries it (the
    pipeline's sparse-gradient path), other transports reject it.
``quantized``
    integer ``codes`` with float ``scale`` per bucket of ``bucket_size`` elements; when ``shared_scale``
    is true every worker used the same scale, so the codes can be summed exactly as integers.

Whatever the kind, :meth:`Payload.to_dense` returns the decompressed flat tensor and the aggregate of
several payloads is the sum of their ``to_dense()``; transports compute that sum compactly.

**Wire encoding.** In memory a payload keeps convenient dtypes (int8 codes, int64 indices, float
powers of two); on the wire it travels in the encoding its declared ``bits`` count
(``theory/compressors.py``). A transport that ships payloads as they are (allgather) calls
:meth:`Payload.wire_layout` (per slot ``values``/``indices``/``scale``: the element count, the
in-memory dtype and an encoding code; what a header carries), :meth:`Payload.to_wire` (the tensors
that travel, exactly :func:`slot_nbytes` bytes each) and, on receipt, :func:`empty_slot` (a buffer sized
from a layout the receiver has checked with :func:`check_slot`) and :meth:`Payload.from_wire` (the
bit-exact payload back). It never needs to know the compressor. Encodings (``codec.bits``):

=============  =====================================================  ==========================
encoding       what travels                                           bytes for ``n`` elements
=============  =====================================================  ==========================
``RAW``        the tensor in its dtype                                ``n * itemsize``
``SIGNS``      one bit per code, set for negative codes (scaled        ``ceil(n / 8)``
               sign, signSGD, 1-bit SGD: codes in ``{-1, +1}``)
``INT`` k      k-bit two's complement codes (TernGrad: 2, QSGD s:      ``ceil(n k / 8)``
               ``1 + ceil(log2(s + 1))``)
``NATURAL``    sign + exponent of signed powers of two (natural         9, 7 (float16), 12 (float64)
               compression)                                           bits per entry
``DITHER`` k   natural dithering's codes ``0, +-2^j`` as signed level  ``ceil(n k / 8)``
               index ``sign * (j + 1)`` in k-bit two's complement
``INDEX32``    int64 indices as int32 (``d <= 2^31``)                  ``4 n``
``BITMAP``     strictly increasing indices as a ``d``-bit bitmap       ``ceil(d / 8)``
               (when smaller than 32-bit indices)
=============  =====================================================  ==========================

Transports that form sums on the wire (ring, omnireduce, switch, native) cannot ship packed codes or
sign + exponent: a sum of powers of two is not a power of two, a partial sum of k-bit codes needs more
than k bits. They carry the in-memory values (docs/transports.md, "Bytes on the wire").
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from .errors import InvalidValueError, WireFormatError

KINDS: tuple[str, ...] = ("dense", "aligned", "sparse", "quantized")


@dataclass(init=False)
class Payload:
    """A compressed tensor: the tensors that travel plus what is needed to decompress them.

    ``numel``/``shape``/``dtype`` describe the original tensor. ``bits`` is the wire cost in bits
    declared by the compressor (values, indices or bitmap, norms/scales); indices of an ``aligned``
    payload are regenerated from the shared seed and cost nothing.

    Args:
        kind: ``"dense"``, ``"aligned"``, ``"sparse"`` or ``"quantized"`` (which transports can sum it).
        values: the values that travel (codes for ``quantized``).
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
        indices: the positions of ``values`` (``sparse``; an ``aligned`` payload's come from the shared seed).
        scale: the scales of ``quantized`` codes, one per bucket.
        bucket_size: entries per scale (``quantized``) or per index (row-sparse ``sparse``).
        shared_scale: whether every worker uses the same scale (then the codes can be summed as integers).
        bits: the declared wire cost, bits.
        meta: what the compressor needs to decompress, beyond the above.
        values_codec: the wire encoding of ``values``: ``(encoding, parameter)`` (module doc).
    """

    kind: str
    values: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    indices: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bucket_size: int | None = None
    shared_scale: bool = False
    bits: int = 0
    meta: dict = field(default_factory=dict)
    #: wire encoding of ``values``: ``(encoding, parameter)`` (see the module docstring)
    values_codec: tuple = (0, 0)

    # (written out rather than generated with a __post_init__: one call per payload, every round's)
    def __init__(self, kind: str, values: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 indices: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 bucket_size: int | None = None, shared_scale: bool = False, bits: int = 0,
                 meta: dict | None = None, values_codec: tuple = (0, 0)) -> None:
        if kind not in KINDS:
            raise InvalidValueError(f"unknown payload kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        self.kind = kind
        self.values = values
        self.shape = shape if shape.__class__ is torch.Size else torch.Size(shape)
        self.dtype = dtype
        self.indices = indices
        self.scale = scale
        self.bucket_size = bucket_size
        self.shared_scale = shared_scale
        self.bits = bits
        self.meta = {} if meta is None else meta
        self.values_codec = values_codec

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def row_len(self) -> int:
        """Elements per index: ``bucket_size`` for a row-sparse ``sparse`` payload, else 1."""
        return int(self.bucket_size or 1) if self.kind == "sparse" else 1

    @property
    def device(self) -> torch.device:
        """The device of ``values``."""
        return self.values.device

    def to_dense(self) -> torch.Tensor:
        """The decompressed tensor, flat, in the original dtype."""
        d = self.numel
        if self.kind == "dense":
            return self.values.reshape(-1).to(self.dtype)
        if self.kind in ("aligned", "sparse"):
            out = torch.zeros(d, dtype=self.dtype, device=self.values.device)
            if self.row_len > 1 and self.values.numel():
                out.view(-1, self.row_len).index_add_(0, self.indices.reshape(-1),
                                                      self.values.reshape(-1, self.row_len).to(self.dtype))
            elif self.values.numel():
                out.index_add_(0, self.indices.reshape(-1), self.values.reshape(-1).to(self.dtype))
            return out
        # quantized: codes * scale[bucket], computed in at least float32 and rounded once to ``dtype``
        if self.scale is None:
            return self.values.reshape(-1).to(self.dtype)
        work = torch.promote_types(self.dtype, torch.float32)
        out = self.values.reshape(-1).to(work, copy=True)  # one allocation, scaled in place
        scale = self.scale.reshape(-1).to(work)
        if scale.numel() == 1:
            return out.mul_(scale).to(self.dtype)
        bs = int(self.bucket_size)
        n = out.numel()
        full = (n // bs) * bs
        out[:full].view(-1, bs).mul_(scale[: n // bs, None])
        if full < n:
            out[full:].mul_(scale[n // bs])
        return out.to(self.dtype)

    def wire_tensors(self) -> list[torch.Tensor]:
        """The tensors that would travel (aligned indices excluded: they come from the shared seed)."""
        out = [self.values]
        if self.indices is not None and self.kind == "sparse":
            out.append(self.indices)
        if self.scale is not None:
            out.append(self.scale)
        return out

    # ------------------------------------------------------------------------------ wire encoding
    def wire_layout(self) -> list[tuple[int, torch.dtype, int] | None]:
        """Per wire slot (values, indices, scale): ``(count, in-memory dtype, encoding code)``, or
        ``None`` for a slot that does not travel (no indices outside ``sparse``: an ``aligned``
        payload's come from the shared seed; no scale). The bytes of each slot are
        :func:`slot_nbytes` of it."""
        v = self.values.reshape(-1)
        enc, param = self.values_codec
        out: list = [(v.numel(), v.dtype, encode_code(enc, param))]
        if self.kind == "sparse" and self.indices is not None:
            idx = self.indices.reshape(-1)
            out.append((idx.numel(), idx.dtype, encode_code(self._index_encoding(idx), 0)))
        else:
            out.append(None)
        out.append(None if self.scale is None else (self.scale.numel(), self.scale.dtype, RAW))
        return out

    def _index_encoding(self, idx: torch.Tensor) -> int:
        cached = getattr(self, "_wire_index_encoding", None)
        if cached is not None and cached[0] is idx:
            return cached[1]
        d, k = self.numel, idx.numel()
        enc = RAW
        if idx.dtype == torch.int64 and k:
            if self.row_len > 1:    # row indices: never a bitmap (its size would be counted in elements)
                enc = INDEX32 if d <= 2**31 else RAW
            elif d < 32 * k and (k == 1 or bool((idx[1:] > idx[:-1]).all())):
                enc = BITMAP
            elif d <= 2**31:
                enc = INDEX32
        self._wire_index_encoding = (idx, enc)
        return enc

    def wire_nbytes(self) -> int:
        """Bytes this payload's slots take on the wire (what :meth:`to_wire` returns, without packing)."""
        return sum(slot_nbytes(c, dt, code, self.numel) for c, dt, code in filter(None, self.wire_layout()))

    def to_wire(self) -> list[torch.Tensor | None]:
        """The tensors that travel, per slot of :meth:`wire_layout` (``None`` where nothing does)."""
        layout = self.wire_layout()
        tensors = [self.values.reshape(-1), self.indices.reshape(-1) if layout[1] else None,
                   self.scale.reshape(-1) if layout[2] else None]
        return [None if lay is None else encode_slot(t, lay[2], self.numel)
                for t, lay in zip(tensors, layout)]

    @classmethod
    def from_wire(cls, kind: str, shape, dtype: torch.dtype, layout, tensors, *, indices=None,
                  bucket_size: int | None = None, shared_scale: bool = False) -> "Payload":
        """The payload that :meth:`to_wire` encoded, from the received ``tensors`` and their checked
        ``layout``; ``indices`` are an ``aligned`` payload's (from the shared seed). Bit-exact.

        Args:
            kind: the payload kind, as agreed.
            shape: the original shape.
            dtype: the original dtype.
            layout: the checked layout of the wire tensors (:meth:`wire_layout`).
            tensors: the received tensors.
            indices: an ``aligned`` payload's indices.
            bucket_size: as for the constructor.
            shared_scale: as for the constructor.
        """
        shape = torch.Size(shape)
        d = 1
        for s_ in shape:
            d *= int(s_)
        dec = [None if lay is None else decode_slot(t, *lay, numel=d) for t, lay in zip(tensors, layout)]
        values, idx, scale = dec
        if kind != "sparse":
            idx = indices
        enc, param = decode_code(layout[0][2])
        return cls(kind, values, shape, dtype, indices=idx, scale=scale, bucket_size=bucket_size,
                   shared_scale=shared_scale, values_codec=(enc, param))


# ================================================================================== wire encodings


RAW, SIGNS, INT, NATURAL, DITHER, INDEX32, BITMAP = range(7)
ENCODINGS = ("raw", "signs", "int", "natural", "dither", "index32", "bitmap")
_PARAM_MAX = 64


def encode_code(encoding: int, param: int = 0) -> int:
    """One integer naming an encoding and its parameter (a header field)."""
    return int(encoding) | (int(param) << 8)


def decode_code(code: int) -> tuple[int, int]:
    code = int(code)
    enc, param = code & 0xFF, code >> 8
    if not 0 <= enc < len(ENCODINGS) or not 0 <= param <= _PARAM_MAX:
        raise WireFormatError(f"unknown wire encoding code {code}")
    return enc, param


def describe(code: int) -> str:
    enc, param = decode_code(code)
    return ENCODINGS[enc] + (str(param) if param else "")


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def slot_nbytes(count: int, dtype: torch.dtype, code: int, numel: int) -> int:
    """Exact bytes of a slot of ``count`` elements of in-memory ``dtype`` under encoding ``code``, in a
    payload of a length-``numel`` tensor."""
    from .codec import bits

    enc, k = decode_code(code)
    if enc == RAW:
        return count * torch.empty((), dtype=dtype).element_size()
    if enc == SIGNS:
        return bits.packed_nbytes(count, 1)
    if enc in (INT, DITHER):
        return bits.packed_nbytes(count, k)
    if enc == NATURAL:
        return bits.natural_nbytes(count, dtype)
    if enc == INDEX32:
        return 4 * count
    return bits.packed_nbytes(numel, 1)   # BITMAP


def check_slot(count: int, dtype: torch.dtype, code: int, numel: int, *, max_count: int, what: str) -> int:
    """Validate a peer's announced slot against what this rank can bound (``max_count`` from its own
    tensor) before anything is allocated; return its byte size. Raises :class:`WireFormatError`."""
    enc, k = decode_code(code)
    if not 0 <= count <= max_count:
        raise WireFormatError(f"{what}: a peer announced {count} elements, outside [0, {max_count}]")
    ok = {RAW: True, SIGNS: dtype in _INT_DTYPES, INT: dtype in _INT_DTYPES and 1 <= k <= 16,
          DITHER: dtype in _INT_DTYPES and 2 <= k <= 16, NATURAL: dtype in _FLOATS,
          INDEX32: dtype == torch.int64 and numel <= 2**31, BITMAP: dtype == torch.int64}[enc]
    if not ok:
        raise WireFormatError(f"{what}: encoding {describe(code)} cannot carry {dtype}")
    return slot_nbytes(count, dtype, code, numel)


def empty_slot(count: int, dtype: torch.dtype, code: int, numel: int, device=None) -> torch.Tensor:
    """A receive buffer for a (checked) slot: ``count`` elements of ``dtype`` for ``RAW``, int32 for
    ``INDEX32``, else uint8."""
    enc = decode_code(code)[0]
    if enc == RAW:
        return torch.empty(count, dtype=dtype, device=device)
    if enc == INDEX32:
        return torch.empty(count, dtype=torch.int32, device=device)
    return torch.empty(slot_nbytes(count, dtype, code, numel), dtype=torch.uint8, device=device)


def encode_slot(t: torch.Tensor, code: int, numel: int) -> torch.Tensor:
    """The wire form of one slot's flat in-memory tensor ``t``. Values the encoding cannot carry
    exactly (codes out of the k-bit range, a zero code under ``SIGNS``, a natural value that is not a
    signed power of two) raise :class:`WireFormatError` rather than travel wrong."""
    from .codec import bits

    enc, k = decode_code(code)
    if enc == RAW:
        return t
    if enc == SIGNS:
        _check_range(t, -1, 1, "signs")
        if t.numel() and bool((t == 0).any()):
            raise WireFormatError("SIGNS encoding: a code is 0; only -1 and +1 travel as one bit")
        return bits.pack_signs(t)
    if enc == INT:
        _check_range(t, -(1 << (k - 1)), (1 << (k - 1)) - 1, f"{k}-bit codes")
        return bits.pack_bits(t, k)
    if enc == NATURAL:
        return bits.pack_natural(t)
    if enc == DITHER:   # 0, +-2^j -> sign * (j + 1)
        a = t.abs().to(torch.int64)
        if a.numel() and bool((a & (a - 1)).any()):
            raise WireFormatError("DITHER encoding: codes must be 0 or signed powers of two")
        lvl = torch.where(a > 0, _log2_exact(a) + 1, torch.zeros_like(a))
        lvl = torch.where(t < 0, -lvl, lvl)
        _check_range(lvl, -(1 << (k - 1)), (1 << (k - 1)) - 1, f"{k}-bit dither levels")
        return bits.pack_bits(lvl.to(torch.int8 if k <= 8 else torch.int16), k)
    if enc == INDEX32:
        return t.to(torch.int32)
    # BITMAP
    mask = torch.zeros(numel, dtype=torch.int8, device=t.device)
    mask[t] = 1
    return bits.pack_bits(mask, 1)


def _check_range(t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    if t.numel() == 0:
        return
    mn, mx = torch.aminmax(t)
    if int(mn) < lo or int(mx) > hi:
        raise WireFormatError(f"{what}: values in [{int(mn)}, {int(mx)}] do not fit the wire encoding's "
                              f"range [{lo}, {hi}]")


def decode_slot(buf: torch.Tensor, count: int, dtype: torch.dtype, code: int, *, numel: int) -> torch.Tensor:
    """The in-memory tensor (``count`` elements of ``dtype``) that :func:`encode_slot` encoded."""
    from .codec import bits

    enc, k = decode_code(code)
    want = slot_nbytes(count, dtype, code, numel)
    got = buf.numel() * buf.element_size()
    if got != want:
        raise WireFormatError(f"wire slot {describe(code)}: {got} bytes received, {want} announced")
    if enc == RAW:
        return buf
    if enc == SIGNS:
        return bits.unpack_signs(buf, count).to(dtype)
    if enc == INT:
        wide = torch.int8 if k <= 8 else torch.int16
        return bits.unpack_bits(buf, count, k, dtype=wide).to(dtype)
    if enc == NATURAL:
        return bits.unpack_natural(buf, count, dtype)
    if enc == DITHER:
        lvl = bits.unpack_bits(buf, count, k, dtype=torch.int8 if k <= 8 else torch.int16).to(torch.int64)
        mag = torch.where(lvl != 0, torch.ones_like(lvl) << (lvl.abs() - 1).clamp(min=0), torch.zeros_like(lvl))
        return torch.where(lvl < 0, -mag, mag).to(dtype)
    if enc == INDEX32:
        return buf.to(torch.int64)
    bitsv = bits.unpack_bits(buf, numel, 1, signed=False)
    idx = torch.nonzero(bitsv).flatten()
    if idx.numel() != count:
        raise WireFormatError(f"wire bitmap holds {idx.numel()} positions, {count} announced")
    return idx


def _log2_exact(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) of positive int64 powers of two (exact: float64 holds 2^j, j < 63, exactly)."""
    return torch.frexp(a.to(torch.float64))[1].to(torch.int64) - 1


def check_sum_finite(payload: Payload, aggregate: torch.Tensor, who: str = "allreduce") -> None:
    """Raise :class:`~sparsecomm.errors.OverflowError_` when a sum of finite narrow-float (float16 /
    bfloat16) values came back non-finite: the transport summed them in their own dtype and the sum
    overflowed. Every worker holds the same aggregate, so every worker raises."""
    from .errors import OverflowError_

    vdt = payload.values.dtype
    if vdt not in (torch.float16, torch.bfloat16) or aggregate.numel() == 0:
        return
    if bool(torch.isfinite(aggregate).all()):
        return
    raise OverflowError_(
        f"{who}: the sum over workers of {vdt} values overflowed (|sum| > {torch.finfo(vdt).max:g}) in "
        f"a transport that sums in {vdt}; use transport='allgather' (sums in the tensor's dtype), "
        f"compressor 'bf16' (float32's range), or scale the loss down")
