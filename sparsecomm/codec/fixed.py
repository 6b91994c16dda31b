"""Fixed-point conversion for integer in-network aggregation (SwitchML, Sapio et al., NSDI'21).

A programmable switch adds integers, so each worker sends ``q = round(x * f)`` (int32) and the
result is read back as ``sum_w q_w / f``. SwitchML picks one scaling factor per packet of 64 or 256
elements: every worker sends, one packet ahead, the exponent ``e`` of its packet's largest
magnitude; the switch keeps the maximum over workers, and ``f = INT32_MAX / (n * 2^e)`` keeps the
``n``-worker sum inside int32.

Conventions of this module (shared with the switch transport):

* ``scale`` is the factor ``f`` that multiplies the data: ``q = round(x * f)``, ``x ~= q / f``, so
  the quantisation step is ``1 / f``. (A :class:`~sparsecomm.payload.Payload` of kind ``quantized``
  stores the step, i.e. ``Payload.scale = 1 / f``.)
* ``chunk``: with a per-chunk scale, element ``i`` uses ``scale[i // chunk]`` (``ceil(n / chunk)``
  scales); ``chunk=None`` means one scalar scale.
* rounding ``"nearest"``: half away from zero (C ``round``, as the SwitchML client); error
  ``|x - q / f| <= 0.5 / f``. ``"stochastic"``: ``floor(v) + Bernoulli(v - floor(v))`` with
  ``v = x * f``, unbiased (``E[q] = v``), error ``< 1 / f``, driven by a counter-based hash of an
  explicit integer seed and the element's position (deterministic for the seed).
* nothing wraps: a non-finite input raises :class:`~sparsecomm.errors.NonFiniteError`, a value
  whose rounding leaves the integer range raises :class:`~sparsecomm.errors.OverflowError_`, both
  naming the element.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import CodecError, NonFiniteError, OverflowError_
from . import _fixedkernels as KF
from . import _kernels as K
from ._common import BITS, NUMBA_FLOATS, NUMBA_INTS, as_np, check_float, use_numba

__all__ = [
    "to_fixed",
    "from_fixed",
    "chunk_exponents",
    "scale_from_exponents",
    "checked_add_",
]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

#: integer range of the fixed-point formats, as float64 bounds that convert exactly
_RANGE = {
    torch.int32: (-(2.0**31), 2.0**31 - 1),
    torch.int64: (-(2.0**63), float(np.nextafter(2.0**63, 0))),  # 2^63 - 1 is not a float64
}
#: (mantissa bits, bias - 1, smallest exponent reported) of the float formats
_EXP = {torch.float32: (23, 126, -126), torch.float64: (52, 1022, -1022)}


# --------------------------------------------------------------------------- seeds / hash


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _key(seed) -> int:
    """The 64-bit key of the rounding stream of ``seed`` (an int, a torch or numpy Generator)."""
    if isinstance(seed, torch.Generator):
        seed = int(torch.randint(0, 2**62, (1,), generator=seed, device=seed.device).item())
    elif isinstance(seed, np.random.Generator):
        seed = int(seed.integers(0, 2**62))
    elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise CodecError(
            "stochastic rounding needs an explicit seed: an int, a torch.Generator or a "
            f"numpy.random.Generator (got {seed!r})"
        )
    return _mix64((int(seed) + _GOLDEN) & _M64)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _uniforms_torch(key: int, offset: int, n: int, device) -> torch.Tensor:
    """``u_i = (mix64(key + (offset + i + 1) * golden) >> 11) * 2^-53`` in int64 two's complement,
    bit-identical to the numba kernel's uint64 arithmetic."""
    i = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=device)
    z = i * _signed(_GOLDEN) + _signed(key)
    z = (z ^ _lsr(z, 30)) * _signed(_MIX1)
    z = (z ^ _lsr(z, 27)) * _signed(_MIX2)
    z = z ^ _lsr(z, 31)
    return _lsr(z, 11).to(torch.float64) * 2.0**-53


# --------------------------------------------------------------------------- scales


def _scales(scale, n: int, chunk, device) -> tuple[torch.Tensor, int]:
    """(float64 scales, chunk) with ``chunk`` elements per scale; a scalar scale covers everything."""
    if chunk is None:
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise CodecError(f"a per-chunk scale ({scale.numel()} values) needs chunk=...")
            s = scale.detach().reshape(1).to(device=device, dtype=torch.float64)
        else:
            try:
                s = torch.tensor([float(scale)], dtype=torch.float64, device=device)
            except (TypeError, ValueError):
                raise CodecError(f"scale must be a number or a tensor, got {scale!r}") from None
        chunk = max(n, 1)
    else:
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise CodecError(f"chunk must be a positive integer, got {chunk!r}")
        chunk = int(chunk)
        s = torch.as_tensor(scale).detach().reshape(-1).to(device=device, dtype=torch.float64)
        want = -(-n // chunk)
        if s.numel() == 1 and want != 1:
            s = s.expand(want)
        if s.numel() != want:
            raise CodecError(f"{n} elements in chunks of {chunk} need {want} scales, got {s.numel()}")
    if s.numel() and not bool(((s > 0) & torch.isfinite(s)).all()):
        bad = s[~((s > 0) & torch.isfinite(s))][0].item()
        raise CodecError(f"scales must be positive and finite, got {bad}")
    return s, chunk


def _expand(s: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    if s.numel() == 1:
        return s.expand(n)
    return s.repeat_interleave(chunk)[:n] if chunk > 1 else s


# --------------------------------------------------------------------------- quantise


def to_fixed(
    x: torch.Tensor,
    scale,
    *,
    chunk: int | None = None,
    rounding: str = "nearest",
    seed=None,
    offset: int = 0,
    dtype: torch.dtype = torch.int32,
    backend: str = "auto",
) -> torch.Tensor:
    """``q = round(x * scale)`` as int32 (SwitchML's fixed point; Sapio et al. NSDI'21).

    ``x``: float tensor (flattened). ``scale``: a positive number, or with ``chunk`` one scale per
    ``chunk`` consecutive elements (a tensor of ``ceil(n / chunk)``). ``rounding``: ``"nearest"``
    (half away from zero) or ``"stochastic"`` (unbiased; needs ``seed``: an int, or a torch/numpy
    generator from which one int is drawn). ``offset``: position of ``x[0]`` in the rounding stream,
    so that quantising a tensor piecewise with the same seed gives the same codes as quantising it
    whole. ``dtype``: ``torch.int32`` (default) or ``torch.int64``. The product ``x * scale`` is
    formed in float64 on both backends.

    Raises :class:`NonFiniteError` for a NaN/Inf element and :class:`OverflowError_` when a rounded
    value leaves the range of ``dtype``; the message names the first offending element.

    Args:
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    check_float(x)
    if dtype not in _RANGE:
        raise CodecError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if rounding not in ("nearest", "stochastic"):
        raise CodecError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    stochastic = rounding == "stochastic"
    key = _key(seed) if stochastic else 0
    offset = int(offset)
    if offset < 0:
        raise CodecError(f"offset must be >= 0, got {offset}")
    n = x.numel()
    s, chunk = _scales(scale, n, chunk, x.device)
    lo, hi = _RANGE[dtype]
    if use_numba(backend, x.dtype in NUMBA_FLOATS, x):
        q = torch.empty(n, dtype=dtype)
        xs = as_np(x)
        bad = KF.quantize(xs, as_np(s.contiguous()), chunk, stochastic, np.uint64(key), offset, lo, hi, as_np(q))
        if bad >= 0:
            _raise_quantize(float(xs[bad]), bad, float(s[min(bad // chunk, s.numel() - 1)]), dtype)
        return q
    xf = x.reshape(-1)
    v = xf.to(torch.float64) * _expand(s, chunk, n)
    if stochastic:
        r = torch.floor(v)
        r = r + (_uniforms_torch(key, offset, n, x.device) < v - r).to(torch.float64)
    else:
        r = torch.trunc(v)
        r = r + ((v - r).abs() >= 0.5).to(torch.float64) * torch.sign(v)
    good = (r >= lo) & (r <= hi)
    if n and not bool(good.all()):
        i = int(torch.nonzero(~good)[0, 0])
        _raise_quantize(float(xf[i]), i, float(_expand(s, chunk, n)[i]), dtype)
    return torch.where(good, r, 0.0).to(dtype)


def _raise_quantize(value: float, index: int, scale: float, dtype) -> None:
    if not math.isfinite(value):
        raise NonFiniteError(f"cannot convert element {index} = {value} to fixed point (not finite)")
    lo, hi = _RANGE[dtype]
    raise OverflowError_(
        f"fixed-point overflow at element {index}: {value!r} * scale {scale!r} = {value * scale!r} "
        f"rounds outside the {str(dtype).replace('torch.', '')} range [{int(lo)}, {int(hi)}]; "
        "use a smaller scale (e.g. scale_from_exponents with the true number of workers)"
    )


def from_fixed(q: torch.Tensor, scale, *, chunk: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x = q / scale`` (per chunk as in :func:`to_fixed`), computed in float64 then cast to ``dtype``.

    Exact before the cast for ``|q| < 2^53`` and a power-of-two scale. Torch ops on any device.
    """
    if not isinstance(q, torch.Tensor) or q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        raise CodecError(f"q must be an integer tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if not dtype.is_floating_point:
        raise CodecError(f"dtype must be a float dtype, got {dtype}")
    n = q.numel()
    s, chunk = _scales(scale, n, chunk, q.device)
    return (q.reshape(-1).to(torch.float64) / _expand(s, chunk, n)).to(dtype)


def from_fixed_blocks(q: torch.Tensor, blocks: torch.Tensor, scale: float, out: torch.Tensor, *,
                      backend: str = "auto") -> None:
    """Write :func:`from_fixed` ``(q[i], scale)`` as block ``blocks[i]`` of the flat float tensor ``out``, in place:
    ``k = q.shape[1]`` elements a block, the last block of ``out`` possibly short (its first values), the other
    blocks left as they are; ``blocks`` distinct. The same values as ``from_fixed`` then a scatter, without its
    float64 copies: the Numba kernel (CPU) divides each value in float64 and rounds it once to ``out``'s dtype.

    Args:
        q: integer tensor of shape ``(blocks, k)``: the sums of the blocks.
        blocks: integer tensor, the block index of each row of ``q``.
        scale: the scalar scale of every block (float).
        out: the flat float tensor written (float32 or float64 for the kernel).
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    if (not isinstance(q, torch.Tensor) or q.dim() != 2 or q.is_floating_point() or q.is_complex()
            or q.dtype == torch.bool):
        raise CodecError(f"q must be a 2-D integer tensor (one row per block), got {getattr(q, 'dtype', type(q))}")
    k = q.shape[1]
    n = out.numel()
    if len(blocks) != q.shape[0]:
        raise CodecError(f"{len(blocks)} block indices for {q.shape[0]} rows of q")
    if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) * k >= max(n, 1)):
        raise CodecError(f"block indices must lie in [0, {-(-n // max(k, 1))}), got {int(blocks.min())}.."
                         f"{int(blocks.max())}")
    if use_numba(backend, out.dtype in NUMBA_FLOATS, out) and q.dtype in (torch.int32, torch.int64) and q.is_cpu:
        KF.dequantize_blocks(q.detach().contiguous().numpy(), as_np(blocks.to(torch.int64).contiguous()),
                             float(scale), as_np(out))
        return
    if not k or not len(blocks):
        return
    vals = from_fixed(q, float(scale), dtype=out.dtype).reshape(q.shape)
    flat, full = out.reshape(-1), n // k        # (the whole blocks in one indexed write; a short last one apart)
    b = blocks.to(device=out.device, dtype=torch.int64)
    inner = b < full
    flat[:full * k].view(full, k)[b[inner]] = vals[inner.to(vals.device)].to(out.device)
    if not bool(inner.all()):
        flat[full * k:] = vals[int(torch.nonzero(~inner)[-1, 0]), :n - full * k]


# --------------------------------------------------------------------------- SwitchML exponents


def chunk_exponents(x: torch.Tensor, chunk: int, *, backend: str = "auto") -> torch.Tensor:
    """Per chunk of ``chunk`` elements, the exponent ``e`` = smallest integer with ``2^e > max|x|``.

    SwitchML's packet exponent, read from the float bits: ``((bits(max|x|) & 0x7f800000) >> 23) - 126``
    for float32 (``0x7ff0000000000000``, ``>> 52``, ``- 1022`` for float64). An all-zero (or
    subnormal-only) chunk gets the floor ``-126`` (float32) / ``-1022`` (float64), for which
    ``2^e > max|x|`` still holds. float16/bfloat16 (torch path) are handled as their float32 values.
    Returns int32 of ``ceil(n / chunk)`` entries; raises :class:`NonFiniteError` on NaN/Inf.

    Args:
        x: the float tensor.
        chunk: elements per chunk.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    check_float(x)
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise CodecError(f"chunk must be a positive integer, got {chunk!r}")
    chunk = int(chunk)
    n = x.numel()
    nc = -(-n // chunk)
    if use_numba(backend, x.dtype in NUMBA_FLOATS, x):
        uint, absmask = BITS[x.dtype]
        mbits, bias1, _ = _EXP[x.dtype]
        amax = np.empty(nc, dtype=uint)
        K.block_absmax(as_np(x).view(uint), chunk, absmask, amax)
        expfield = (amax >> mbits).astype(np.int64)
        allones = (1 << (63 - mbits if x.dtype == torch.float64 else 31 - mbits)) - 1
        if nc and expfield.max() == allones:
            _raise_nonfinite(x)
        return torch.from_numpy((expfield - bias1).astype(np.int32))
    xf = x.reshape(-1)
    if xf.dtype not in NUMBA_FLOATS:
        xf = xf.float()
    _, _, emin = _EXP[xf.dtype]
    a = xf.abs()
    amax = torch.empty(nc, dtype=xf.dtype, device=x.device)
    full = n // chunk
    if full:
        amax[:full] = a[: full * chunk].view(full, chunk).amax(dim=1)
    if nc > full:
        amax[full] = a[full * chunk :].amax()
    if nc and not bool(torch.isfinite(amax).all()):
        _raise_nonfinite(x)
    e = torch.frexp(amax).exponent.to(torch.int32)
    return torch.where(amax > 0, e.clamp_min(emin), emin).to(torch.int32)


def block_facts(x: torch.Tensor, block: int, *, backend: str = "auto") -> tuple[bool, int, torch.Tensor]:
    """``(finite, e, mask)`` of the float tensor ``x`` in one read: whether every element is finite, the tensor's
    exponent (``chunk_exponents(x, n)[0]``, the floor for an empty or all-zero tensor; the floor too when
    ``finite`` is False) and :func:`~.blocks.nonzero_blocks` ``(x, block)``, what a job that sends the non-zero
    blocks of one fixed-point scale needs (the sparse switch: SwitchML's exponent, Sapio et al., NSDI'21, over
    OmniReduce's blocks, Fei et al., SIGCOMM'21).

    Numba kernel (CPU float32/float64): one pass of per-block maxima of ``|x|``'s bit patterns
    (``block_absmax``), from which the three facts are read: a block is non-zero iff its maximum pattern is
    (NaN/Inf included, ``-0.0`` not), an element is not finite iff a block's maximum has an all-ones exponent
    field, and the tensor's exponent is that of the largest block maximum. Elsewhere the three functions,
    each a pass.

    Args:
        x: the float tensor.
        block: elements per block (the last one may be short).
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    from .blocks import nonzero_blocks

    check_float(x)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise CodecError(f"block must be a positive integer, got {block!r}")
    n = x.numel()
    if use_numba(backend, x.dtype in NUMBA_FLOATS, x):
        uint, absmask = BITS[x.dtype]
        mbits, bias1, emin = _EXP[x.dtype]
        amax = np.empty(-(-n // int(block)), dtype=uint)
        K.block_absmax(as_np(x).reshape(-1).view(uint), int(block), absmask, amax)
        mask = torch.from_numpy(amax != 0)
        if not n:
            return True, emin, mask
        expfield = int(amax.max()) >> mbits
        allones = (1 << (63 - mbits if x.dtype == torch.float64 else 31 - mbits)) - 1
        if expfield == allones:
            return False, emin, mask
        return True, expfield - bias1, mask
    xf = x.reshape(-1)
    finite = bool(torch.isfinite(xf).all()) if n else True
    e = int(chunk_exponents(xf, n, backend=backend)[0]) if finite and n else _EXP.get(xf.dtype, _EXP[torch.float32])[2]
    return finite, e, nonzero_blocks(xf, block, backend=backend)


def _raise_nonfinite(x: torch.Tensor) -> None:
    xf = x.reshape(-1)
    i = int(torch.nonzero(~torch.isfinite(xf))[0, 0])
    raise NonFiniteError(f"element {i} = {float(xf[i])} is not finite; it cannot be sent as fixed point")


def scale_from_exponents(e, num_workers: int, *, bits: int = 32, power_of_two: bool = False) -> torch.Tensor:
    """Scaling factors that keep the ``num_workers``-worker integer sum inside ``bits``-bit integers.

    ``e``: the exponents of the chunks, maximised over workers (:func:`chunk_exponents` on each worker,
    then the element-wise max -- what the SwitchML switch computes). Returns float64
    ``f = (Q / n - 1) * 2^-e`` with ``Q = 2^(bits-1) - 1``: SwitchML's ``INT32_MAX / (n * 2^e)`` (the
    p4app-switchML client's exponent quantizer) less one unit of headroom, which makes the guarantee
    hold for both rounding modes: every ``|x| < 2^e`` gives ``|round(x f)| < |x f| + 1 <= Q / n``, so
    each code is ``<= floor(Q / n)`` and the sum of ``n`` codes is ``<= Q`` -- never an overflow.
    ``power_of_two=True`` rounds ``f`` down to a power of two (then ``x * f`` and ``q / f`` are exact
    and the error bound ``0.5 / f`` holds with no float rounding; at most one bit of precision lost).

    Exponents are clamped from below at ``bits - 1022`` so that ``f`` stays finite for all-zero
    float64 chunks (still ``2^e > max|x|``).
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
        raise CodecError(f"num_workers must be a positive integer, got {num_workers!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 64:
        raise CodecError(f"bits must be an integer in [2, 64], got {bits!r}")
    c = (2.0 ** (bits - 1) - 1) / num_workers - 1.0
    if c < 1.0:
        raise CodecError(f"{bits}-bit integers cannot hold the sum of {num_workers} workers with any useful scale")
    et = torch.as_tensor(e)
    if et.is_floating_point() or et.is_complex() or et.dtype == torch.bool:
        raise CodecError(f"exponents must be integers, got {et.dtype}")
    et = et.to(torch.float64).clamp_min(float(bits - 1022))
    if power_of_two:
        return torch.exp2(math.floor(math.log2(c)) - et)
    return c * torch.exp2(-et)


# --------------------------------------------------------------------------- integer sums


def checked_add_(acc: torch.Tensor, x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``acc += x`` for int32/int64 tensors, raising :class:`OverflowError_` instead of wrapping.

    What a switch aggregator slot does with the workers' fixed-point codes (SwitchML), with the
    overflow that hardware would wrap silently reported, naming the first offending element. On
    error ``acc`` is left unchanged. Returns ``acc``.

    Args:
        acc: the accumulator, added to in place.
        x: the codes added.
        backend: ``"auto"`` (the Numba kernel on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``
            (:mod:`sparsecomm.kernels`).
    """
    for name, t in (("acc", acc), ("x", x)):
        if not isinstance(t, torch.Tensor) or t.dtype not in NUMBA_INTS:
            raise CodecError(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if x.dtype != acc.dtype:
        raise CodecError(f"acc is {acc.dtype} but x is {x.dtype}")
    if x.numel() != acc.numel():
        raise CodecError(f"acc has {acc.numel()} elements but x has {x.numel()}")
    if x.device != acc.device:
        raise CodecError(f"acc is on {acc.device} but x is on {x.device}")
    info = torch.iinfo(acc.dtype)
    if use_numba(backend, True, acc, x):
        a, b = as_np(acc), as_np(x)
        bad = KF.checked_add(a, b, info.min, info.max)
        if bad >= 0:
            _raise_add(int(a[bad]), int(b[bad]), bad, acc.dtype)
        return acc
    af, xf = acc.reshape(-1), x.reshape(-1)
    if acc.dtype == torch.int32:
        s = af.to(torch.int64) + xf.to(torch.int64)
        badm = (s < info.min) | (s > info.max)
    else:
        s = af + xf  # wraps; overflow iff both operands' signs differ from the result's
        badm = ((af ^ s) & (xf ^ s)) < 0
    if acc.numel() and bool(badm.any()):
        i = int(torch.nonzero(badm)[0, 0])
        _raise_add(int(af[i]), int(xf[i]), i, acc.dtype)
    acc.copy_(s.to(acc.dtype).view(acc.shape))
    return acc


def _raise_add(a: int, b: int, index: int, dtype) -> None:
    raise OverflowError_(
        f"integer overflow at element {index}: {a} + {b} = {a + b} does not fit in "
        f"{str(dtype).replace('torch.', '')}"
    )
