"""``signsgd``: signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD
with majority vote is communication efficient and fault tolerant", ICLR 2019)::

    worker i: send s_i = sign(g_i)        (one bit per coordinate; sign(0) := +1)
    all:      estimate = sign(sum_i s_i)  (the majority vote; a tie gives 0)

The messages are ``quantized`` codes in {-1, +1} with the *shared* scale 1 (``VoteSign``), so ring,
omnireduce, switch and native sum them exactly as integers: the vote happens in the network, and
the sum of n one-bit codes needs only ceil(log2(n+1)) + 1 bits.

Bytes on the wire (the declared bits count 1 per coordinate): ``allgather`` ships each worker's signs
packed, 1 bit each, (n-1) copies received per worker, as declared. A summing transport carries partial
sums of up to n votes, which no 1-bit unit holds: the ring sends them in the narrowest integer dtype
that holds n (int8 up to 127 workers, then int16: ``VoteSign.sum_bits``), 2 (n-1)/n copies of 8 bits
per coordinate, i.e. 8x the declared bits, which ``compression_stats()`` reports as ``sent_over_declared``
(omnireduce: int8 blocks, also ~8x; the switch: 32-bit fixed point per vote, ~36x with packet headers).
``transport="auto"`` takes the cheaper of the two: allgather while (n - 1) x 1 bit < 2 (n-1)/n x 8 bits,
i.e. for n < 16 workers, the ring beyond. The estimate's magnitude is 1 per
coordinate: the learning rate sets the step (the paper's x <- x - lr sign(sum_i sign(g_i))). If each
worker's sign is wrong with probability p < 1/2, independently, the vote is wrong with probability
``theory.majority_vote_error(n, p)``, which falls exponentially in n. Stateless. An exact round
(warm-up) sends g_i itself and the estimate is the sign of the true sum.
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from ..compressors import _kernels as K
from ..compressors._common import cpu_empty, flat_input, make_payload, raise_nonfinite, use_numba, work_dtype
from ..compressors.base import Compressor
from ..payload import SIGNS
from .base import Method


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


class SignSGD(Method):
    """``get("signsgd")``: majority vote of the workers' gradient signs."""

    name = "signsgd"
    State = None

    def __init__(self) -> None:
        super().__init__(VoteSign())

    def hyper(self):
        return {}

    def _message(self, grad, ms):
        return grad

    def _encode(self, grad, ms, generator, exact):
        ms.pending = exact
        msg = self._message(grad, ms)
        # an exact round's dense payload is the message itself: a copy where the message is state
        return self._compress(msg.clone() if exact and msg is not grad else msg, generator, exact)

    def _decode(self, aggregate, world_size, ms, out):
        ms.take_pending(self.name)
        torch.sign(aggregate, out=out)
