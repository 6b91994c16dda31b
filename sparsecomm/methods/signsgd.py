"""``signsgd``: signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD
with majority vote is communication efficient and fault tolerant", ICLR 2019)::

    worker i: send s_i = sign(g_i)        (one bit per coordinate; sign(0) := +1)
    all:      estimate = sign(sum_i s_i)  (the majority vote; a tie gives 0)

The messages are ``quantized`` codes in {-1, +1} with the *shared* scale 1
(:class:`~sparsecomm.compressors.vote.VoteSign`), so ring,
omnireduce, switch and native sum them exactly as integers: the vote happens in the network, and
the sum of n one-bit codes needs only ceil(log2(n+1)) + 1 bits.

Bytes on the wire (the declared bits count 1 per coordinate): ``allgather`` ships each worker's signs
packed, 1 bit each, (n-1) copies received per worker, as declared. A summing transport carries partial
sums of up to n votes, which no 1-bit unit holds: the ring sends them in the narrowest integer dtype
that holds n (int8 up to 127 workers, then int16: ``VoteSign.sum_bits``), 2 (n-1)/n copies of 8 bits
per coordinate, i.e. 8x the declared bits, which ``compression_stats()`` reports as ``sent_over_declared``
(omnireduce: int8 blocks, also ~8x; the switch: 32-bit fixed point per vote, ~36x with packet headers).
The default transport (``transport="default"``) takes the cheaper of the two: allgather while (n - 1) x 1 bit < 2 (n-1)/n x 8 bits,
i.e. for n < 16 workers, the ring beyond. The estimate's magnitude is 1 per
coordinate: the learning rate sets the step (the paper's x <- x - lr sign(sum_i sign(g_i))). If each
worker's sign is wrong with probability p < 1/2, independently, the vote is wrong with probability
``theory.majority_vote_error(n, p)``, which falls exponentially in n. Stateless. An exact round
(warm-up) sends g_i itself and the estimate is the sign of the true sum.
"""

from __future__ import annotations

import torch

from ..compressors.vote import VoteSign
from .base import Method


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

    def _encode(self, grad, ms, generator, exact, world_size):
        ms.pending = exact
        msg = self._message(grad, ms)
        # an exact round's dense payload is the message itself: a copy where the message is state
        return self._compress(msg.clone() if exact and msg is not grad else msg, generator, exact)

    def _decode(self, aggregate, world_size, ms, out):
        ms.take_pending(self.name)
        torch.sign(aggregate, out=out)
