"""``onebit``: 1-bit SGD with error feedback (Seide, Fu, Droppo, Li, Yu, "1-bit stochastic gradient
descent and its application to data-parallel distributed training of speech DNNs", Interspeech 2014)::

    worker i: p_i = g_i + e_i;  q_i = s_b sign(p_i) per bucket b,  s_b = mean_{j in b} |p_ij|
              e_i <- p_i - q_i;  send q_i                    (1 bit per entry + one level per bucket)
    all:      estimate = (1/n) sum_i q_i

Seide et al. quantise each column to one bit and carry the quantisation error into the next
minibatch ("error feedback"). They reconstruct a column from two levels, the means of its positive
and of its negative entries; here one symmetric level per bucket, the mean |p| (the error-minimising
symmetric level), keeps the message a standard ``quantized`` payload (int8 codes +-1, one scale per
bucket of ``bucket_size``) that every wire format packs to one bit. Per bucket the error is
||p_b||^2 - ||p_b||_1^2/b, so the operator is contractive with delta = 1/b (``theory.onebit_delta``,
tight at a spike) and the residual e_i is bounded. The levels differ between workers, so the sum
travels through ``allgather`` (a per-worker scale).
"""

from __future__ import annotations

import torch

from theory import compressors as th

from ..compressors._common import (check_bucket_size, flat_input, make_payload, raise_nonfinite, scale_dtype,
                                   work_dtype)
from ..compressors.base import Compressor
from . import registry
from .ef import ErrorFeedback


class OneBit(Compressor):
    """codes sign(x) (sign(0) := +1) with the level mean|x| of each bucket of ``bucket_size``."""

    name, payload_kind, shared_scale = "onebit", "quantized", False

    def __init__(self, bucket_size: int | None = 512) -> None:
        self.bucket_size = check_bucket_size(bucket_size)

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        b = min(self.bucket_size or max(d, 1), max(d, 1))
        a = flat.to(work_dtype(x.dtype)).abs()
        nb = -(-d // b)
        sums = torch.zeros(nb, dtype=a.dtype, device=a.device).index_add_(
            0, torch.arange(d, device=a.device) // b, a)
        counts = torch.full((nb,), float(b), dtype=a.dtype, device=a.device)
        if d % b:
            counts[-1] = d % b
        scale = (sums / counts).to(scale_dtype(x.dtype))
        if not bool(torch.isfinite(scale).all()):
            raise_nonfinite(self.name)
        codes = torch.where(flat < 0, -1, 1).to(torch.int8)
        return make_payload("quantized", x.shape, x.dtype, codes, scale=scale, bucket_size=b,
                            shared_scale=False, wire_bits={"values": d, "scale": 8 * scale.element_size() * nb})

    def delta(self, d):
        return th.onebit_delta(min(self.bucket_size or max(d, 1), max(d, 1)))

    def bits(self, d, dtype=torch.float32):
        return th.onebit_bits(d, self.bucket_size, torch.finfo(scale_dtype(dtype)).bits)

    def hyper(self):
        return {"bucket_size": self.bucket_size}


@registry.register("onebit")
class OneBitSGD(ErrorFeedback):
    """``get("onebit", bucket_size=512)``: error feedback around :class:`OneBit`."""

    name = "onebit"

    def __init__(self, bucket_size: int | None = 512) -> None:
        super().__init__(OneBit(bucket_size))

    def hyper(self):
        return {"bucket_size": self.compressor.bucket_size}
