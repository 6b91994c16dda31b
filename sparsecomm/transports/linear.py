"""Linear operands: the one lowering of every input that a transport sums in compressed form.

A tensor and the payloads whose aggregate is an element-wise sum of one vector per worker are *linear*:

- a tensor, or a ``dense`` payload: the values (a payload's in their own dtype: a float16 payload
  travels and is summed in float16, as an fp16 all-reduce does), cast to the payload's dtype after;
- ``aligned``: the value vectors (every worker holds values at the same indices), scattered into the
  dense result at the shared indices after;
- ``quantized`` with a shared scale: the integer codes (float codes that hold integers become int64;
  any other float code is an error), summed exactly, then multiplied by the shared scale
  (:meth:`Payload.to_dense <sparsecomm.payload.Payload.to_dense>` of the summed codes).

:func:`linear_operand` returns the :class:`LinearOperand`: the vector, how to finish its sum into the
aggregate, and what every worker must agree on, both as agreement-handshake fields (length, dtype,
kind, the shared indices' or scale's checksum: :mod:`._handshake`) and as one 64-bit word
(:attr:`LinearOperand.check`) for protocols that carry a single word of it in their own header (the
switches' control round, OmniReduce's round 0). :meth:`Transport._allreduce_payload
<sparsecomm.transports.base.Transport._allreduce_payload>` lowers the kinds a transport declares
(``Transport.linear``) and hands the operand to the transport's ``_sum_linear``, so no transport lowers
a payload by hand. :func:`guarded_sum` is the sum of an operand that the dense baselines (``ring``,
``native``) share: the handshake, an integer accumulator that cannot overflow, the non-finite rules
(:func:`guarded_vector_role` and :func:`guarded_finish`: the same, for a reduction that is a role).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import IncompatibleError, InvalidValueError
from ..fabric.base import Fabric
from ..payload import Payload
from ._guards import abs_max, guard_finite, int_accumulator, is_integer, narrow
from .buffers import advises, fresh_clone
from ._handshake import KIND_CODE, agreement_role, check_agreement, dtype_code, fingerprint

#: mixes a quantized payload's bucket size into its scale's checksum (:attr:`LinearOperand.check`)
_BUCKET_MIX = 0x9E3779B1


@dataclass
class LinearOperand:
    """The vector whose element-wise sum over workers gives the aggregate, and how to finish."""

    vector: torch.Tensor                              # flat; summed in its own dtype
    finish: Callable[[torch.Tensor], torch.Tensor]    # summed vector -> flat dense aggregate
    fields: dict                                      # handshake fields every worker must agree on
    kind: str = "dense"                               # the payload kind it stands for (a tensor: dense)
    dtype: torch.dtype | None = None                  # the aggregate's dtype (None: the vector's)
    inplace: bool = False                             # ``vector`` is the caller's and may take the sum
    codes: bool = False                               # integer codes: summed in the narrowest dtype that
                                                      # holds the n-worker sum, finished in that dtype

    def work_copy(self, fabric: Fabric) -> torch.Tensor:
        """A vector the caller may overwrite: a copy, unless the operand may be summed in place (a
        contiguous input of the caller's, as with DDP's ``gradient_as_bucket_view``). A copy is made into a
        buffer allocated for it, advised as huge pages when large (:func:`.buffers.fresh_clone`), and declared
        to ``fabric``'s host model (:func:`fresh_copy`).

        On a fabric whose time is modelled (``fabric.modelled_time``: a SimFabric) the copy is declared the same
        (an advised buffer from the threshold on: the modelled host's), but its own buffer is a plain one: there
        the buffers are the simulator's, every simulated worker's work copy alive at once in one process, whose
        fresh huge pages by the gigabyte cost the loop more than the small pages they replace; the advice is for a
        real endpoint, whose one process allocates its buffer afresh on every call (:mod:`.buffers`)."""
        v = self.vector
        if self.inplace and v.is_contiguous():
            return v
        return fresh_copy(fabric, fresh_clone(v, advise=not fabric.modelled_time),
                          advised=advises(v.numel() * v.element_size(), v.device))

    @property
    def check(self) -> int:
        """What the workers must share beyond length and dtype, as one 64-bit word: the checksum of the
        aligned indices, or of the quantized scale mixed with the bucket size; 0 for dense values."""
        if "indices_checksum" in self.fields:
            return int(self.fields["indices_checksum"])
        if "scale_checksum" in self.fields:
            return int(self.fields["scale_checksum"]) ^ (self.fields["bucket_size"] * _BUCKET_MIX)
        return 0


def fresh_copy(fabric: Fabric, t: torch.Tensor, *, advised: bool = False) -> torch.Tensor:
    """``t``, a copy a call has just made into a buffer allocated for it, declared to ``fabric``'s host model
    (:meth:`~sparsecomm.fabric.base.Fabric.host_work`): its bytes copied (``"copy"``) and a fresh buffer of
    them (``"fresh"``; ``advised``: one that :mod:`.buffers` advised as huge pages, ``"fresh_advised"``);
    returns ``t``."""
    fabric.host_work("copy", t.nbytes)
    fabric.host_work("fresh_advised" if advised else "fresh", t.nbytes)
    return t


def linear_operand(x: torch.Tensor | Payload, transport: str, *, inplace: bool = False) -> LinearOperand:
    """Turn a tensor or a linearly summable payload into a :class:`LinearOperand` (module docstring);
    ``inplace``: a tensor ``x`` may take its own sum."""
    if isinstance(x, torch.Tensor):
        flat = x if x.dim() == 1 else x.reshape(-1)
        return LinearOperand(flat, lambda s: s, dict(length=flat.numel(), dtype=dtype_code(flat.dtype),
                                                     payload_kind=0, values_length=flat.numel(),
                                                     values_dtype=dtype_code(flat.dtype)),
                             dtype=flat.dtype, inplace=inplace)
    p = x
    common = dict(length=p.numel, dtype=dtype_code(p.dtype), payload_kind=KIND_CODE[p.kind])
    if p.kind == "dense":
        v = p.values.reshape(-1)
        if v.numel() != p.numel:
            raise InvalidValueError(f"dense payload has {v.numel()} values for a tensor of {p.numel} elements")
        return LinearOperand(v, lambda s: s.to(p.dtype),
                             dict(common, values_length=v.numel(), values_dtype=dtype_code(v.dtype)),
                             dtype=p.dtype)
    if p.kind == "aligned":
        v = p.values.reshape(-1)
        idx = p.indices.reshape(-1)

        def finish_aligned(s: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(p.numel, dtype=p.dtype, device=s.device)
            if s.numel():
                out.index_add_(0, idx.to(s.device), s.to(p.dtype))
            return out

        return LinearOperand(v, finish_aligned, dict(common, values_length=v.numel(),
                                                     values_dtype=dtype_code(v.dtype),
                                                     indices_checksum=fingerprint(idx)),
                             kind="aligned", dtype=p.dtype)
    if p.kind == "quantized":
        if not p.shared_scale:
            raise IncompatibleError(f"transport {transport!r} sums quantized codes as integers, which needs a "
                                    f"scale shared by every worker; use 'allgather' for per-worker scales")
        codes = _integer_codes(p.values.reshape(-1), transport)

        def finish_quantized(s: torch.Tensor) -> torch.Tensor:
            return Payload("quantized", s, p.shape, p.dtype, scale=p.scale, bucket_size=p.bucket_size,
                           shared_scale=True).to_dense()

        return LinearOperand(codes, finish_quantized,
                             dict(common, values_length=codes.numel(), values_dtype=dtype_code(codes.dtype),
                                  bucket_size=int(p.bucket_size or 0), scale_checksum=fingerprint(p.scale)),
                             kind="quantized", dtype=p.dtype, codes=True)
    raise IncompatibleError(f"transport {transport!r} cannot sum {p.kind!r} payloads in compressed form")


def _integer_codes(codes: torch.Tensor, transport: str) -> torch.Tensor:
    """Quantized codes as integers: as they are, or float codes that hold integers as int64."""
    if is_integer(codes.dtype):
        return codes
    if codes.is_floating_point() and bool((torch.isfinite(codes) & (codes == codes.round())).all()):
        return codes.to(torch.int64)
    raise IncompatibleError(f"transport {transport!r} sums quantized codes as integers; this payload's codes "
                            f"({codes.dtype}) are not integers")


def guarded_sum(fabric: Fabric, what: str, op: LinearOperand, extra: dict, nonfinite: str,
                reduce: Callable[[torch.Tensor], torch.Tensor],
                int_floor: torch.dtype = torch.int8) -> torch.Tensor:
    """The agreement handshake (with the integer bound as an ``info`` field), ``reduce`` in a dtype that
    cannot overflow, then the overflow / non-finite rules of :mod:`._guards`; the summed vector.
    Quantized codes are summed in the narrowest integer dtype that holds the n-worker sum, integer
    tensors in their own dtype or wider; never narrower than ``int_floor``, the narrowest integer
    dtype ``reduce`` takes (``native`` passes int32: gloo's all_reduce rejects int8).

    Every worker holds the same sum, so every check after ``reduce`` raises on every worker alike.
    :func:`guarded_vector_role` and :func:`guarded_finish` are the same for a transport whose reduction is a
    role."""
    got = check_agreement(fabric, what, **op.fields, **extra, info=_guard_info(op))
    vec, wide = _to_sum(fabric, what, op, got, int_floor)
    return guarded_finish(fabric, what, op, reduce(vec), wide, nonfinite)


def guarded_vector_role(fabric: Fabric, inbox, what: str, op: LinearOperand, extra: dict,
                        int_floor: torch.dtype = torch.int8):
    """:func:`guarded_sum`'s handshake as a role (:mod:`sparsecomm.fabric.roles`): the agreement
    (:func:`~._handshake.agreement_role`, on ``inbox``); it returns ``(vector, widened)``, the vector to
    reduce in the dtype :func:`guarded_sum` would choose and whether it is a widened copy (for
    :func:`guarded_finish`). A reduction role runs it first in its own frame (the ring's ``prologue``), so
    that its many requests do not pass a frame around it."""
    got = yield from agreement_role(fabric, inbox, what, **op.fields, **extra, info=_guard_info(op))
    return _to_sum(fabric, what, op, got, int_floor)


def _guard_info(op: LinearOperand) -> dict:
    """The handshake's ``info`` fields of ``op``: the largest magnitude of an integer vector."""
    return {"int_bound": abs_max(op.vector)} if is_integer(op.vector.dtype) else {}


def _to_sum(fabric: Fabric, what: str, op: LinearOperand, got: dict,
            int_floor: torch.dtype) -> tuple[torch.Tensor, bool]:
    """The vector to reduce, given the handshake's result ``got``, and whether it is a widened copy (an
    integer vector summed in a wider dtype: :func:`guarded_finish` narrows it back)."""
    v = op.vector
    if is_integer(v.dtype):
        wide = int_accumulator(torch.int8 if op.codes else v.dtype, fabric.world_size, got["int_bound"][0], what)
        if torch.iinfo(wide).bits < torch.iinfo(int_floor).bits:
            wide = int_floor
        if wide != v.dtype:
            return fresh_copy(fabric, v.to(wide)), True
    return op.work_copy(fabric), False


def guarded_finish(fabric: Fabric, what: str, op: LinearOperand, total: torch.Tensor, widened: bool,
                   nonfinite: str) -> torch.Tensor:
    """The summed vector after :func:`guarded_sum`'s rules: a widened integer sum narrowed back (range-checked;
    quantized codes stay wide), a float sum checked for NaN/Inf (:func:`._guards.guard_finite`)."""
    if widened:
        return total if op.codes else narrow(total, op.vector.dtype, what)
    if nonfinite != "pass" and total.is_floating_point():
        fabric.host_work("check", total.numel())       # (the guard's pass over the sum: sim_host)
    guard_finite(fabric, what, total, op.vector if total is not op.vector else None, nonfinite)
    return total
