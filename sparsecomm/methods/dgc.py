"""``dgc``: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018). Worker i keeps the
momentum u_i and the accumulation v_i (both 0 at first)::

    local clipping:       g <- g min(1, (clip_norm N^(-1/2)) / ||g||)           (if clip_norm is set)
    momentum correction:  u <- m u + g;   v <- v + u
    sampled threshold:    t = the ceil(keep s)-th largest |v_j| of s sampled entries
    send                  v_j for |v_j| >= t (at most k = round(keep d): the k largest of them)
    factor masking:       v_j <- 0, u_j <- 0 for the sent j;   estimate = (1/n) sum_i sent_i

The momentum lives here, so the inner optimizer must be momentum-free SGD (the update is the sum of
the sent accumulated velocities). ``keep`` follows the warm-up ``theory.dgc_keep`` (1/4, 1/16,
1/64, 1/256 over ``warmup_steps``, then ``ratio``, 0.1% in the paper); s = ``theory.dgc_sample_size``
entries drawn uniformly with the worker's own generator (the operator:
:class:`~sparsecomm.compressors.sampled_topk.SampledTopK`).

Local gradient clipping (§3.2 of the paper, arXiv:1712.01887, "Local Gradient Clipping", part of
"Improving the local gradient accumulation"; checked against the paper's text): each worker clips its
own gradient *before* adding it to its accumulation (here: before the momentum correction), and the
norm threshold is scaled by N^(-1/2), which the paper calls the worker's share of the global
threshold if all N workers' gradients were identically distributed (derived: the norm of a sum of N
such independent zero-mean gradients grows as sqrt(N)). N is ``encode``'s ``world_size``. The norm
is that of the tensor this method sees for one key (a bucket or a parameter), as the authors'
released code clips each named tensor in its momentum-correction memory
(github.com/synxlin/deep-gradient-compression, ``dgc/memory.py``, ``dgc/clip_grad.py``).

An exact round (warm-up) sends v whole without masking u: dense momentum SGD. The payload is
``sparse`` (worker-specific positions): allgather or omnireduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsecomm.theory import compressors as th

from ..compressors.sampled_topk import SampledTopK
from .base import Method, check_finite
from ..errors import InvalidValueError


@dataclass
class DGCState:
    """Per-bucket state of ``dgc``: the accumulation ``v``, the momentum ``u``, the step."""

    velocity: torch.Tensor
    momentum: torch.Tensor
    step: int


class DGC(Method):
    """``get("dgc", ratio=0.001, momentum=0.9, sample_ratio=0.01, warmup_steps=0, clip_norm=None)``."""

    name, State = "dgc", DGCState

    def __init__(self, ratio: float = th.DGC_RATIO, *, momentum: float = th.DGC_MOMENTUM,
                 sample_ratio: float = th.DGC_SAMPLE_RATIO, warmup_steps: int = 0,
                 clip_norm: float | None = None) -> None:
        if not 0.0 <= momentum < 1.0 or warmup_steps < 0 or (clip_norm is not None and not clip_norm > 0):
            raise InvalidValueError("dgc: momentum in [0, 1), warmup_steps >= 0, clip_norm > 0 or None")
        self.momentum, self.warmup_steps, self.clip_norm = float(momentum), int(warmup_steps), clip_norm
        super().__init__(SampledTopK(ratio, sample_ratio))

    def hyper(self):
        c = self.compressor
        return {"ratio": c.ratio, "momentum": self.momentum, "sample_ratio": c.sample_ratio,
                "warmup_steps": self.warmup_steps, "clip_norm": self.clip_norm}

    def init_state(self, d, dtype, device):
        return DGCState(torch.zeros(d, dtype=dtype, device=device), torch.zeros(d, dtype=dtype, device=device), 0)

    def _encode(self, grad, ms, generator, exact, world_size):
        st = ms.state
        check_finite(grad, self.name)
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(world_size)
            norm = float(grad.norm())
            if norm > limit:
                grad.mul_(limit / norm)
        st.momentum.mul_(self.momentum).add_(grad)
        st.velocity.add_(st.momentum)
        keep = th.dgc_keep(st.step, self.compressor.ratio, self.warmup_steps)
        st.step += 1
        ms.pending = exact
        if exact:
            msg = self._compress(st.velocity.clone(), generator, True)
            st.velocity.zero_()
            return msg
        msg = self.compressor.compress(st.velocity, generator, keep=keep)
        st.velocity.index_fill_(0, msg.indices, 0.0)
        st.momentum.index_fill_(0, msg.indices, 0.0)
        return msg

    def _decode(self, aggregate, world_size, ms, out):
        ms.take_pending(self.name)
        torch.div(aggregate, world_size, out=out)
