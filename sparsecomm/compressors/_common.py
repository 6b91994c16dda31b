"""Shared plumbing of the operators: errors, hyper-parameter checks, generators, payload building.

Randomness (decided here, once): a random operator draws only from the ``torch.Generator`` handed to
``compress(x, generator)`` and holds none of its own (:func:`check_generator`: ``None`` raises
:class:`GeneratorRequiredError`). The global torch and numpy RNGs are never touched. Numba kernels draw
one 64-bit key from the generator per call and derive per-element uniforms from it with the SplitMix64
finaliser (a counter-based stream), so the generator is the only source of randomness and advances by
the same amount on every worker.

Wire accounting: every payload's ``bits`` is the sum of ``payload.meta["wire_bits"]`` (bits per wire
tensor role: ``values``, ``indices``, ``scale``) under the encodings documented in
``theory/compressors.py``; in memory, tensors may be wider than their wire encoding (int64 indices,
int8 codes, float powers of two), never narrower. The payload's ``values_codec`` names the wire
encoding of its values (:mod:`sparsecomm.payload`: signs, k-bit codes, natural sign + exponent), so
that what :meth:`Payload.to_wire` ships is what ``bits`` counts.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .. import kernels as _kernel_paths
from . import _kernels as _k
from ..errors import InvalidValueError, NonFiniteError
from ..payload import Payload
from ..errors import CompressorConfigError, CompressorInputError, GeneratorRequiredError  # noqa: F401 (re-exported)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------ hyper-parameters
def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (0.0 < float(ratio) <= 1.0):
        raise CompressorConfigError(f"ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def check_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CompressorConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise CompressorConfigError(f"{name} must be an integer {rng}, got {value!r}")
    return value


def check_bucket_size(bucket_size) -> int | None:
    return None if bucket_size is None else check_int("bucket_size", bucket_size, 1)


class SizeRule:
    """How many entries a sparsifier keeps of a length-d input: ``ratio`` or ``k`` (exactly one).

    ``k(d) = clamp(round(ratio * d), 1, d)`` (round half up) or ``min(k, d)``; ``k(0) = 0``.
    """

    def __init__(self, ratio=None, k=None, who: str = "compressor") -> None:
        if (ratio is None) == (k is None):
            raise CompressorConfigError(f"{who} takes exactly one of ratio= or k=, got ratio={ratio!r}, k={k!r}")
        self.ratio = None if ratio is None else check_ratio(ratio)
        self.k = None if k is None else check_int("k", k, 1)

    def __call__(self, d: int) -> int:
        if d <= 0:
            return 0
        if self.k is not None:
            return min(self.k, d)
        return min(d, max(1, int(math.floor(self.ratio * d + 0.5 + 1e-9))))

    def hyper(self) -> dict:
        return {"ratio": self.ratio} if self.ratio is not None else {"k": self.k}


# ----------------------------------------------------------------------------------------- input
def flat_input(x: torch.Tensor, who: str) -> torch.Tensor:
    """The flattened, contiguous, detached view of ``x`` (a copy only when ``x`` is not contiguous)."""
    if not isinstance(x, torch.Tensor):
        raise CompressorInputError(f"{who}.compress expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise CompressorInputError(
            f"{who}.compress expects a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    if type(x) is torch.Tensor and x.ndim == 1 and not x.requires_grad and x.is_contiguous():
        return x        # (already flat, contiguous and outside autograd: the three calls below change nothing)
    return x.detach().reshape(-1).contiguous()


_NP_OF = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def cpu_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory numpy allocated: numpy advises huge pages for large
    buffers (fewer page faults at first touch), torch's CPU allocator does not."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.empty(n, dtype=np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.empty(n, dtype=_NP_OF[dtype]))


def abs_max(flat: torch.Tensor) -> float:
    """max |x| (NaN or Inf when x holds one; 0 for an empty tensor)."""
    if flat.numel() == 0:
        return 0.0
    if use_numba(flat) and flat.dtype in (torch.float32, torch.float64):
        a = flat.numpy()
        if a.dtype == np.float32:
            out = np.empty(1, dtype=np.int32)
            _k.bucket_absmax_bits(a.view(np.int32), a.size, np.int32(0x7FFFFFFF), out)
            return float(out.view(np.float32)[0])
        out = np.empty(1, dtype=np.int64)
        _k.bucket_absmax_bits(a.view(np.int64), a.size, np.int64(0x7FFFFFFFFFFFFFFF), out)
        return float(out.view(np.float64)[0])
    m = flat.abs().max()
    return float(m) if bool(torch.isfinite(flat).all()) else math.nan


def gather(flat: torch.Tensor, idx: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, bool]:
    """``flat[idx] * scale`` in ``flat``'s dtype (the product computed in at least float32) and whether
    every gathered value is finite. Numba on CPU float32/float64 (no torch thread-pool round trip for
    these small gathers), torch elsewhere."""
    if use_numba(flat) and flat.dtype in (torch.float32, torch.float64):
        a = flat.numpy()
        out = np.empty(idx.numel(), dtype=a.dtype)
        ok = _k.gather_scaled(a, idx.numpy(), a.dtype.type(scale), out)
        return torch.from_numpy(out), bool(ok)
    vals = flat[idx]
    ok = bool(torch.isfinite(vals).all())
    if scale != 1.0:
        vals = (vals.to(work_dtype(flat.dtype)) * scale).to(flat.dtype)
    return vals, ok


def dtype_bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of per-bucket norms/scales: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the kernels compute in: float64 for float64, float32 for everything narrower (exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite(x: torch.Tensor) -> bool:
    """True when no entry of ``x`` (any shape) is NaN or Inf: one Numba pass for float32/float64 CPU tensors
    (``torch.isfinite(x).all()`` writes a mask first, 10-20x slower on one thread), torch elsewhere."""
    if x.numel() == 0:
        return True
    if use_numba(x) and x.dtype in (torch.float32, torch.float64):
        return bool(_k.all_finite(x.detach().reshape(-1).numpy()))
    return bool(torch.isfinite(x).all())


#: the largest power of two whose reciprocal is a normal float32 (and float64): ``1 / n`` exact in both
_POW2_EXACT = 2 ** 126


def divide_finite(x: torch.Tensor, n: int) -> bool:
    """``x /= n`` in place (``n`` a positive integer) and whether every quotient is finite, i.e. whether every
    element of ``x`` was: one Numba pass over a flat contiguous float32/float64 CPU tensor, torch's ``div_``
    then :func:`all_finite` elsewhere. The pass is torch's ``div_`` by ``n`` bit for bit: a multiplication by
    ``1 / n`` where ``n`` is a power of two (:func:`._kernels.scale_finite`: the same correctly rounded
    quotients, a multiplication's throughput rather than a division's, the DDP hook's plain average at 2, 4,
    8, ... workers), else a division (:func:`._kernels.div_finite`)."""
    # (use_numba(x), inlined: a frame less in the DDP hook's completion)
    if x.is_cpu and not _kernel_paths.torch_forced() and x.dtype in (torch.float32, torch.float64) and \
            x.ndim == 1 and x.is_contiguous():
        a = x.detach().numpy()
        if n & (n - 1) or not 0 < n <= _POW2_EXACT:
            return bool(_k.div_finite(a, a.dtype.type(n)))
        return bool(_k.scale_finite(a, a.dtype.type(1.0 / n)))
    x.div_(n)
    return all_finite(x)


def add_finite(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> bool:
    """``out <- x + y`` (flat tensors of one dtype and length; ``out`` is ``x`` or distinct from both) and whether
    every sum is finite: one Numba pass for float32/float64 CPU tensors, torch's add then :func:`all_finite`
    elsewhere (the same sums: one IEEE addition each)."""
    if use_numba(out) and out.dtype in (torch.float32, torch.float64) and x.dtype == y.dtype == out.dtype:
        if out is x:
            return bool(_k.iadd_finite(x.detach().numpy(), y.detach().numpy()))
        return bool(_k.add_finite(x.detach().numpy(), y.detach().numpy(), out.detach().numpy()))
    torch.add(x, y, out=out)
    return all_finite(out)


def copy_sub(x: torch.Tensor, m: torch.Tensor, out: torch.Tensor, diff: torch.Tensor) -> None:
    """``out <- x`` and ``diff <- m - x`` (flat tensors of one dtype and length, ``x`` aliasing neither output):
    one Numba pass for float32/float64 CPU tensors, torch's copy and subtraction elsewhere (the same values)."""
    if use_numba(out) and out.dtype in (torch.float32, torch.float64) and x.dtype == m.dtype == out.dtype == diff.dtype:
        _k.copy_sub(x.detach().numpy(), m.detach().numpy(), out.detach().numpy(), diff.detach().numpy())
        return
    out.copy_(x)
    torch.sub(m, x, out=diff)


def raise_nonfinite(who: str) -> None:
    raise NonFiniteError(f"{who}: the input contains NaN or Inf; only finite tensors can be compressed")


# ------------------------------------------------------------------------------------ randomness
def check_generator(who: str, generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """``generator``, checked: a ``torch.Generator`` on ``device``'s type; ``None`` raises
    :class:`GeneratorRequiredError` (a random operator never uses the global RNG nor one of its own)."""
    if generator is None:
        raise GeneratorRequiredError(
            f"{who} is random and never uses the global RNG: call compress(x, generator) with a "
            f"torch.Generator (the optimizer and the DDP hook pass theirs)")
    if not isinstance(generator, torch.Generator):
        raise CompressorInputError(f"{who}: generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise CompressorInputError(
            f"{who}: the generator is on {generator.device} but the tensor is on {device}; "
            f"pass torch.Generator(device={device.type!r})")
    return generator


def draw_key(generator: torch.Generator) -> int:
    """One 64-bit key (as a Python int in [0, 2**64)) drawn from ``generator`` for a Numba stream."""
    hi_lo = torch.randint(0, 2**32, (2,), generator=generator, dtype=torch.int64,
                          device=generator.device).tolist()
    return (int(hi_lo[0]) << 32) | int(hi_lo[1])


# ------------------------------------------------------------------------------------- backends
def use_numba(x: torch.Tensor) -> bool:
    """Numba kernels for CPU tensors, torch ops elsewhere, and everywhere under ``sc.kernels.force("torch")``
    (see :mod:`sparsecomm.kernels`: which outputs agree bit for bit across the two paths). ``is_cpu`` rather
    than ``device.type``: the same answer without building a ``torch.device`` (a 20th of its cost per call)."""
    return x.is_cpu and not _kernel_paths.torch_forced()


def force_backend(name: str):
    """Run every operator on the ``"torch"`` or ``"numba"`` path: :func:`sparsecomm.kernels.force`."""
    if name not in ("torch", "numba"):
        raise InvalidValueError(f"backend must be 'torch' or 'numba', got {name!r}")
    return _kernel_paths.force(name)


# -------------------------------------------------------------------------------------- payload
def widen_divide(values: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out = values / n`` with ``values`` widened into ``out``'s dtype first (exact), bit for bit as
    ``torch.div(out.copy_(values), n, out=out)``: one Numba pass for float16 (where ``_kernels.NATIVE_HALF``)
    or bfloat16 ``values`` into a contiguous float32 CPU ``out`` (:func:`._kernels.widen_div_f16`,
    :func:`._kernels.widen_div_bf16`), those two torch ops elsewhere. Returns ``out``."""
    if not _widen_div_kernel(values, n, out):
        torch.div(out.copy_(values.reshape(out.shape)), n, out=out)
    return out


def widen_divide_finite(values: torch.Tensor, n: int, out: torch.Tensor) -> bool:
    """:func:`widen_divide` (``n`` a positive integer), and whether every element of ``values`` is finite, from
    the same Numba pass where it runs (each quotient is finite iff its element was); elsewhere the torch ops,
    then :func:`all_finite` of ``out``."""
    ok = _widen_div_kernel(values, n, out)
    if ok is None:
        torch.div(out.copy_(values.reshape(out.shape)), n, out=out)
        return all_finite(out)
    return ok


def _widen_div_kernel(values: torch.Tensor, n: int, out: torch.Tensor) -> bool | None:
    """:func:`widen_divide`'s Numba pass where it applies, returning whether every quotient is finite;
    None (nothing done) elsewhere."""
    bf = values.dtype == torch.bfloat16
    if out.dtype == torch.float32 and (bf or (values.dtype == torch.float16 and _k.NATIVE_HALF)) and \
            use_numba(values) and out.is_cpu and values.numel() == out.numel() and \
            values.is_contiguous() and out.is_contiguous():
        v = values if values.dim() == 1 else values.reshape(-1)
        o = out if out.dim() == 1 else out.reshape(-1)
        return bool((_k.widen_div_bf16 if bf else _k.widen_div_f16)(v.view(torch.int16).numpy(), np.float32(n),
                                                                   o.numpy()))
    return None


def decompressed(payload: Payload) -> torch.Tensor:
    """``payload.to_dense()`` (flat), bit for bit, written into a numpy-allocated buffer (see
    :func:`cpu_empty`) for CPU payloads of float32 / float64: ``dense`` bfloat16 (and, where
    ``_kernels.NATIVE_HALF``, float16) ones of float32 by one Numba pass on this thread
    (:func:`._kernels.widen_bf16`, :func:`._kernels.widen_f16`), other narrower ``dense`` ones by torch's
    cast, ``quantized`` ones by one Numba pass (int8 or int16 codes for float32, any integer codes for
    float64: the code's conversion is exact and the product rounds once, as in torch), ``sparse`` ones of
    one value per index likewise; ``Payload.to_dense`` elsewhere."""
    v, dt = payload.values, payload.dtype
    if dt not in (torch.float32, torch.float64) or not use_numba(v) or not v.is_contiguous():
        return payload.to_dense()
    if payload.kind == "dense" and v.dim() == 1 and dt == torch.float32 and (
            v.dtype == torch.bfloat16 or (v.dtype == torch.float16 and _k.NATIVE_HALF)):
        return _widened(v, payload.numel)
    d = payload.numel
    if d == 0 or (payload.kind in ("quantized", "dense") and v.numel() != d):
        return payload.to_dense()
    if payload.kind == "dense":     # a cast (fp16, bf16) into a numpy-allocated buffer, else v itself
        if v.dtype == dt:
            return v.reshape(-1)
        out = cpu_empty(d, dt)
        if dt == torch.float32 and (v.dtype == torch.bfloat16 or (v.dtype == torch.float16 and _k.NATIVE_HALF)):
            widen = _k.widen_bf16 if v.dtype == torch.bfloat16 else _k.widen_f16
            widen(v.reshape(-1).view(torch.int16).numpy(), out.numpy())
            return out
        return out.copy_(v.reshape(-1))
    scale = payload.scale
    if payload.kind == "quantized" and scale is not None and scale.device.type == "cpu" and (
            v.dtype in (torch.int8, torch.int16) or (dt == torch.float64 and not v.dtype.is_floating_point)):
        bs = d if scale.numel() == 1 else int(payload.bucket_size or 0)
        if bs < 1 or scale.numel() != -(-d // bs):
            return payload.to_dense()
        out = cpu_empty(d, dt)
        _k.dequantize(v.reshape(-1).numpy(), scale.reshape(-1).to(dt).contiguous().numpy(), bs, out.numpy())
        return out
    idx = payload.indices
    if payload.kind == "sparse" and payload.row_len == 1 and v.dtype == dt and idx is not None and \
            idx.dtype == torch.int64 and idx.device.type == "cpu" and idx.is_contiguous() and \
            idx.numel() == v.numel():
        out = cpu_empty(d, dt)
        if _k.scatter_dense(idx.reshape(-1).numpy(), v.reshape(-1).numpy(), out.numpy()):
            return out
    return payload.to_dense()   # (an index out of range raises there)


def _widened(v: torch.Tensor, d: int) -> torch.Tensor:
    """:func:`decompressed` of a ``dense`` float16 / bfloat16 payload of float32 whose ``values`` are flat and
    contiguous on the CPU: one Numba pass into a numpy-allocated buffer, with the fewest torch calls (each costs
    microseconds, a cast of a million elements tens of them): the numpy views are taken on the numpy side."""
    if v.numel() != d or d == 0:
        return v.reshape(-1).to(torch.float32)      # (what Payload.to_dense does)
    out = np.empty(d, dtype=np.float32)
    if v.dtype == torch.float16:
        _k.widen_f16(v.numpy().view(np.int16), out)
    else:
        _k.widen_bf16(v.view(torch.int16).numpy(), out)
    return torch.from_numpy(out)


def make_payload(kind: str, x_shape, dtype, values: torch.Tensor, wire_bits: dict[str, int], *,
                 indices=None, scale=None, bucket_size=None, shared_scale=False, values_codec=(0, 0),
                 **meta) -> Payload:
    """A payload whose ``bits`` is the sum of ``wire_bits`` (recorded in ``meta['wire_bits']``);
    ``values_codec`` is the values' wire encoding (:mod:`sparsecomm.payload`), RAW by default."""
    wire = {k: int(v) for k, v in wire_bits.items()}
    return Payload(kind=kind, values=values, shape=torch.Size(x_shape), dtype=dtype, indices=indices,
                   scale=scale, bucket_size=bucket_size, shared_scale=shared_scale,
                   bits=sum(wire.values()), meta={"wire_bits": wire, **meta}, values_codec=tuple(values_codec))
