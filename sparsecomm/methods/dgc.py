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
entries drawn uniformly with the worker's own generator.

Local gradient clipping (§3.2 of the paper, arXiv:1712.01887, "Local Gradient Clipping", part of
"Improving the local gradient accumulation"; checked against the paper's text): each worker clips its
own gradient *before* adding it to its accumulation (here: before the momentum correction), and the
norm threshold is scaled by N^(-1/2), which the paper calls the worker's share of the global
threshold if all N workers' gradients were identically distributed (derived: the norm of a sum of N
such independent zero-mean gradients grows as sqrt(N)). N is the pipeline's ``world_size``. The norm
is that of the tensor this method sees for one key (a bucket or a parameter), as the authors'
released code clips each named tensor in its momentum-correction memory
(github.com/synxlin/deep-gradient-compression, ``dgc/memory.py``, ``dgc/clip_grad.py``).

An exact round (warm-up) sends v whole without masking u: dense momentum SGD. The payload is
``sparse`` (worker-specific positions): allgather or omnireduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sparsecomm.theory import compressors as th

from ..compressors import _kernels as K
from ..compressors._common import (GeneratorRequiredError, check_ratio, gather, make_payload, raise_nonfinite,
                                   use_numba)
from ..compressors.base import Compressor
from .base import Method
from ..errors import InvalidValueError


class SampledTopK(Compressor):
    """The entries of x at or above a threshold estimated from a uniform sample (at most k of them)."""

    name, payload_kind = "dgc", "sparse"

    def __init__(self, ratio: float, sample_ratio: float) -> None:
        self.ratio, self.sample_ratio = check_ratio(ratio), check_ratio(sample_ratio)

    def compress(self, x, generator=None, keep: float | None = None):
        flat = x.reshape(-1)
        d, keep = flat.numel(), keep or self.ratio
        k, s = min(d, max(1, round(keep * d))), th.dgc_sample_size(d, keep, self.sample_ratio)
        if s < d and generator is None:
            raise GeneratorRequiredError("dgc samples its threshold with the worker's generator (never the "
                                         "global RNG): pass one (the optimizer and the DDP hook do)")
        pick = None if s >= d else torch.randint(0, d, (s,), generator=generator, device=flat.device)
        sample = _abs_at(flat, pick)
        thr = float(torch.topk(sample, min(s, math.ceil(keep * s)), sorted=False).values.min()) if d else 0.0
        idx = _at_or_above(flat, thr)
        if idx.numel() > k:
            idx = idx[torch.topk(_abs_at(flat, idx), k, sorted=False).indices].sort().values
        return make_payload("sparse", x.shape, x.dtype, gather(flat, idx)[0], indices=idx,
                            wire_bits={"values": torch.finfo(x.dtype).bits * idx.numel(),
                                       "indices": th.index_bits(d, idx.numel())})

    def delta(self, d):
        return 0.0   # a sampled threshold may send fewer than k entries: no worst-case contraction

    def bits(self, d, dtype=torch.float32):
        return th.topk_bits(d, min(d, max(1, round(self.ratio * d))), torch.finfo(dtype).bits)


def _numba(flat: torch.Tensor) -> bool:
    return use_numba(flat) and flat.dtype in (torch.float32, torch.float64)


def _abs_at(flat: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """``|x[idx]|`` (``|x|`` for ``idx = None``); a Numba gather on CPU float32/float64."""
    if idx is None:
        return flat.abs()
    if not _numba(flat):
        return flat[idx].abs()
    xn = flat.contiguous().numpy()
    out = np.empty(idx.numel(), dtype=xn.dtype)
    K.abs_gather(xn, idx.numpy(), out)
    return torch.from_numpy(out)


def _at_or_above(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """The indices (increasing) of the entries with ``|x_i| >= thr``, ``thr`` a value of x's dtype (or NaN:
    none). Numba: one pass over x, no |x| temporary (CPU float32/float64); torch ops elsewhere."""
    if not _numba(flat):
        return torch.nonzero(flat.abs() >= thr).reshape(-1)
    xn = flat.contiguous().numpy()
    buf = np.empty(xn.size, dtype=np.int64)     # only the pages that receive indices are touched
    return torch.from_numpy(buf[:K.collect_ge(xn, xn.dtype.type(thr), buf)].copy())


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

    def _encode(self, grad, ms, generator, exact):
        st = ms.state
        if st is None:
            st = ms.state = DGCState(torch.zeros_like(grad), torch.zeros_like(grad), 0)
        if not bool(torch.isfinite(grad).all()):
            raise_nonfinite(self.name)
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(self.world_size or 1)
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
