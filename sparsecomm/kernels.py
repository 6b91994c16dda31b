"""Which implementation runs the element loops of the codec and the operators: Numba kernels or torch ops.

Every hot loop of :mod:`sparsecomm.codec` and :mod:`sparsecomm.compressors` exists twice: as a Numba
kernel (contiguous CPU tensors of the dtypes it handles) and as torch ops (everything else: CUDA tensors,
non-contiguous views, float16/bfloat16). Each call picks by default ("auto"). This switch sends the
"auto" choice to one path for the whole process, so that CPU-only CI runs what a GPU user runs::

    with sc.kernels.force("torch"):          # the torch path on CPU tensors too
        ...
    SPARSECOMM_KERNELS=torch python -m pytest # the same for a whole process (read once, at import)

``"torch"``: every "auto" call takes the torch path. ``"numba"``: "auto" as usual (Numba wherever it can
run: a Numba kernel never runs on a CUDA tensor). ``"auto"``: no forcing. An explicit ``backend=``
argument of a codec function wins over the switch. The switch is process-wide, not per thread: set it
around whole runs, not from inside concurrent workers.

**Agreement between the paths** (tests/codec/ and tests/compressors/ run on both; the test suite's
``kernel_path`` fixture in tests/conftest.py):

- deterministic kernels agree **bit for bit**: block scan, pack, unpack-add, bitmaps, indices, look-ahead,
  chunk exponents, fixed point (nearest and the codec's counter-based stochastic rounding), checked add;
  the operators top-k, threshold, identity, fp16/bf16 casts, sign's and the vote's codes, DGC's sampled
  selection, every ``decompress``, 1-bit SGD's codes and residual given its levels; a scale that is a sum
  over a bucket (sign's l1 norm, 1-bit SGD's levels) agrees to rounding only (the paths sum in different
  orders: n ulp for n terms; the Numba path sums in float64 and rounds once);
- random operators agree **in distribution only**: rand-k, QSGD, TernGrad, natural compression and
  dithering draw different (equally distributed) values from the same generator state, and advance the
  generator by different amounts (Numba draws one 64-bit key per call; torch draws per element).
  Workers that share a seed (shared-seed rand-k, whose compact aggregate needs identical coordinates on
  every worker) must therefore run the same path: the same device type and the same switch.
"""

from __future__ import annotations

import contextlib
import os

from .errors import SparseCommError
from .errors import KernelPathError  # noqa: F401 (re-exported)

PATHS = ("auto", "numba", "torch")


def _check(name: str) -> str:
    if name not in PATHS:
        raise KernelPathError(f"kernel path must be one of {', '.join(PATHS)}, got {name!r}")
    return name


#: the forced path ("auto" = none); read on every dispatch, so a plain module attribute
_forced: str = _check(os.environ.get("SPARSECOMM_KERNELS", "auto") or "auto")


def forced() -> str:
    """The current switch: ``"auto"``, ``"numba"`` or ``"torch"``."""
    return _forced


def torch_forced() -> bool:
    """True when every "auto" dispatch must take the torch path."""
    return _forced == "torch"


@contextlib.contextmanager
def force(name: str):
    """Within the block, dispatch "auto" calls to ``name`` (``"torch"``, ``"numba"`` or ``"auto"``)."""
    global _forced
    old, _forced = _forced, _check(name)
    try:
        yield name
    finally:
        _forced = old
