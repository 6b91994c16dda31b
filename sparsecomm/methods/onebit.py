"""``onebit``: 1-bit SGD with error feedback (Seide, Fu, Droppo, Li, Yu, "1-bit stochastic gradient
descent and its application to data-parallel distributed training of speech DNNs", Interspeech 2014)::

    worker i: p = g + e;  per bucket b (a column in the paper) of ``bucket_size`` entries:
              c_j = sign(p_j) (sign(0) := +1);  q_j = mean{p_l : c_l = c_j, l in b}    (two levels)
              e <- p - q;   send c (1 bit each) and the two levels of every bucket
    all:      estimate = (1/n) sum_i q_i

Two levels per bucket, the means of its non-negative and of its negative entries, are the paper's
reconstruction (also GRACE's ``onebit``). On the wire they are q_j = a_b + s_b c_j with
s_b = (mean+ - mean-)/2 >= 0 and a_b = (mean+ + mean-)/2: round 1 is a standard ``quantized``
payload (codes +-1, one scale s_b per bucket, which every wire format packs to one bit), round 2 the
offsets a_b (dense, one per bucket). ``levels="symmetric"`` drops round 2 with the single level
mean|p| (s_b = ||p_b||_1/b, a_b = 0), as DeepSpeed's and BytePS's 1-bit compressors do. Both are
contractive with delta = 1/b (``theory.onebit_delta``, tight at a single spike; the two-level error
is never above the symmetric one), so the residual e stays bounded. The scales differ between
workers: the codes travel through ``allgather``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressors.onebit import OneBit, expand, residual
from ..payload import Payload
from ..compressors._common import add_finite
from .base import Method, dense_payload, raise_input_nonfinite
from ..errors import InvalidValueError

LEVELS = ("two", "symmetric")


@dataclass
class OneBitState:
    """Per-bucket state of ``onebit``: the worker's residual ``e``."""

    error: torch.Tensor


class OneBitSGD(Method):
    """``get("onebit", bucket_size=512, levels="two")``."""

    name, multi_round, State = "onebit", True, OneBitState
    #: p = g + e is checked before the residual changes (an exact round's add, a compressed round's levels)
    checks_input = True

    def __init__(self, bucket_size: int | None = 512, *, levels: str = "two") -> None:
        if levels not in LEVELS:
            raise InvalidValueError(f"onebit: levels must be one of {LEVELS}, got {levels!r}")
        super().__init__(OneBit(bucket_size, levels == "two"))

    def hyper(self):
        return {"bucket_size": self.compressor.bucket_size,
                "levels": "two" if self.compressor.two_level else "symmetric"}

    def init_state(self, d, dtype, device):
        return OneBitState(torch.zeros(d, dtype=dtype, device=device))

    def _encode(self, grad, ms, generator, exact, world_size):
        st = ms.state
        if exact:       # (a compressed round's levels check p = g + e: OneBit.levels raises before the residual)
            if not add_finite(grad, st.error, grad):
                raise_input_nonfinite(self.name, "g + e (the gradient plus the error-feedback residual)")
            p = grad
            st.error.zero_()
            ms.pending = ("exact",)
            return dense_payload(p)
        p = grad.add_(st.error)
        codes, s, a, b = self.compressor.levels(p)
        residual(p, codes, s, a, b, st.error)
        ms.pending = ("codes", a, b)
        return self.compressor.payload(p, codes, s, b)

    def _next_round(self, aggregate, world_size, ms):
        pend = ms.pending
        if pend[0] != "codes" or pend[1] is None:
            return None
        ms.pending = ("offsets", aggregate.clone(), pend[2])
        a = pend[1]
        return Payload("dense", a, a.shape, a.dtype, bits=8 * a.numel() * a.element_size())

    def _decode(self, aggregate, world_size, ms, out):
        pend = ms.take_pending(self.name)
        if pend[0] == "offsets":                       # codes' sum + the offsets' sum, per bucket
            torch.add(pend[1], expand(aggregate.to(pend[1].dtype), pend[2], out.numel()), out=out)
            out.div_(world_size)
        else:
            torch.div(aggregate, world_size, out=out)
