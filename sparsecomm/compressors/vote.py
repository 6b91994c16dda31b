"""signSGD's majority-vote codes (Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with majority
vote is communication efficient and fault tolerant", ICLR 2019): the operator methods ``signsgd`` and
``signum`` send (:mod:`sparsecomm.methods.signsgd`), not in the catalog.

    C(x) = sign(x) as int8 codes in {-1, +1} (sign(0) := +1), with the *shared* scale 1

A ``quantized`` payload every summing transport adds exactly as integers (the vote happens in the
network); on the wire the codes are one bit each (``SIGNS`` encoding, ``theory.sign_vote_bits``) where no
sum is formed, and the narrowest integer that holds a partial sum of n votes where one is
(:meth:`VoteSign.sum_bits`).
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from . import _kernels as K
from ._common import cpu_empty, flat_input, make_payload, raise_nonfinite, use_numba, work_dtype
from .base import Compressor
from ..payload import SIGNS


class VoteSign(Compressor):
    """sign(x) as int8 codes with the shared scale 1 (a ``quantized`` payload every transport sums)."""

    name, payload_kind, shared_scale = "votesign", "quantized", True
    #: travels packed (1 bit) only where no sum is formed on the wire: ``auto`` weighs allgather's packed
    #: copies against a summing transport's ``sum_bits`` per element
    packed_values = True

    @staticmethod
    def sum_bits(n: int) -> int:
        """Bits per element of a partial sum of ``n`` workers' votes on a summing transport: the
        narrowest integer dtype holding ``[-n, n]`` (what the ring sends)."""
        return next(b for b in (8, 16, 32, 64) if n <= 2 ** (b - 1) - 1)

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        if use_numba(flat):     # one pass: the codes and the finiteness check
            codes = cpu_empty(flat.numel(), torch.int8)
            finite = K.vote_codes(flat.to(work_dtype(flat.dtype)).numpy(), codes.numpy())
        else:
            finite = bool(torch.isfinite(flat).all())
            codes = torch.where(flat < 0, -1, 1).to(torch.int8)
        if not finite:
            raise_nonfinite(self.name)
        one = torch.ones(1 if flat.numel() else 0, dtype=torch.float32, device=flat.device)
        return make_payload("quantized", x.shape, x.dtype, codes, scale=one, bucket_size=max(flat.numel(), 1),
                            shared_scale=True, wire_bits={"values": th.sign_vote_bits(flat.numel())},
                            values_codec=(SIGNS, 0))

    def bits(self, d, dtype=torch.float32):
        return th.sign_vote_bits(d)
