"""The compressor contract (CONTRIBUTING.md, "Contracts in code").

A compressor is a stateless, pure operator ``C``: ``compress(x, generator) -> Payload`` and
``decompress(payload) -> Tensor`` with the shape and dtype of ``x``. It never communicates and never
touches the global RNG: all randomness comes from the ``torch.Generator`` handed in.

It declares the properties that ``theory/`` and the validators read:

- ``unbiased``: E[C(x)] = x;
- ``omega(d)``: variance constant, E||C(x) - x||^2 <= omega ||x||^2 (class U(omega));
- ``delta(d)``: contraction constant, E||C(x) - x||^2 <= (1 - delta) ||x||^2 (class B(delta));
- ``payload_kind``: which transports can carry its output;
- ``shared_randomness``: every worker must use the same generator seed (shared-seed rand-k), which
  the optimizer arranges;
- ``elementwise``: C acts on each coordinate alone, deterministically (identity, the fp16/bf16
  casts), so compressing a concatenation is concatenating the compressions: the pipeline may then
  compress a whole bucket at once instead of parameter by parameter;
- ``checks_finite``: ``compress`` raises :class:`~sparsecomm.errors.NonFiniteError` on a NaN or Inf in
  its input, and has no other effect then (the pipeline then needs no check of its own);
  :meth:`Compressor.compress_finite` is ``compress`` of an input the caller has found finite, with that pass
  left out (a method that checks its compressed input calls it);
- ``shared_scale``: a ``quantized`` payload's scale is the same on every worker (so a summing transport
  can add the integer codes);
- ``packed_values``: the values travel packed (fewer bits than stored) only where no sum is formed on the
  wire (allgather); :meth:`Compressor.sum_bits` is what a summing transport sends per element instead.

It declares its host work, what a modelled host charges for it (:mod:`sparsecomm.fabric.sim.sim_host`):
:meth:`Compressor.work` of a ``compress``, :meth:`Compressor.decompress_work` of a ``decompress``, as counts of
the host model's operations (elements of an elementwise pass, elements a top-k selects among, ...).

A random operator holds no generator: called with ``generator=None`` it raises
:class:`~sparsecomm.errors.GeneratorRequiredError` (``_common.py``: ``check_generator``).

:func:`finite` is the test behind ``checks_finite`` and behind the pipeline's NaN/Inf rule.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..payload import Payload
from ._common import all_finite, decompressed


class Compressor(ABC):
    """Base class of every compression operator. Subclasses are registered by name."""

    name: ClassVar[str] = ""
    payload_kind: ClassVar[str] = "dense"
    unbiased: ClassVar[bool] = False
    shared_randomness: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    checks_finite: ClassVar[bool] = False
    shared_scale: ClassVar[bool] = False
    packed_values: ClassVar[bool] = False

    @abstractmethod
    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        """Compress ``x`` (any shape, any float dtype; operates on the flattened view).

        Args:
            x: the tensor.
            generator: the only source of randomness of a random compressor (``None`` for a deterministic
                one).
        """

    def compress_finite(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        """:meth:`compress` of an ``x`` that the caller has found finite (a method that checks its compressed
        input, :attr:`Method.checks_input <sparsecomm.methods.base.Method.checks_input>`, in the pass that formed
        it): the same payload, bit for bit; a compressor whose ``compress`` checks its input in a pass of its own
        (top-k) leaves that pass out. Only for such an ``x``: a NaN or Inf is then not reported.

        Args:
            x: the tensor, every element finite.
            generator: as for :meth:`compress`.
        """
        return self.compress(x, generator)

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The decompressed tensor, with the shape and dtype of the compressed input
        (``payload.to_dense()``, bit for bit: :func:`._common.decompressed`)."""
        out = decompressed(payload)
        shape = payload.shape
        if len(shape) == 1 and out.dim() == 1 and out.shape[0] == shape[0]:
            return out      # (already the shape: a reshape to a torch.Size costs more than a small cast)
        return out.reshape(shape)

    def omega(self, d: int) -> float:
        """Variance constant of U(omega); ``inf`` for a biased compressor.

        Args:
            d: the vector's length.
        """
        return math.inf

    def delta(self, d: int) -> float:
        """Contraction constant of B(delta); 0 when the compressor is not contractive.

        Args:
            d: the vector's length.
        """
        return 0.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> int:
        """Bits one payload of a length-``d`` input of ``dtype`` costs on the wire (the payload's
        ``bits``; its ``meta["wire_bits"]`` splits it by tensor role)."""
        return 32 * d

    @staticmethod
    def sum_bits(n: int) -> int:
        """Bits per element that a transport forming partial sums of ``n`` workers' payloads sends (32:
        a float32 element; narrower for codes whose sums fit a small integer).

        Args:
            n: the number of workers.
        """
        return 32

    def work(self, d: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        """The host work of one ``compress`` of a length-``d`` input of ``dtype``: operation of
        :data:`sparsecomm.fabric.sim.sim_host.CODEC_RATES` (or ``"check"``, elements a finiteness check reads at the
        host model's ``check_element_s``) -> count. The default: one elementwise pass over
        the input and one kernel call (the identity's copy, a cast); a compressor whose work differs says so.

        Args:
            d: the input's length.
            dtype: the input's dtype.
        """
        return {"elementwise": d, "kernel": 1}

    def finite_work(self, d: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        """The host work of one :meth:`compress_finite`: :meth:`work` less the compressor's own finiteness read
        (``"check"``), which ``compress_finite`` leaves out.

        Args:
            d: the input's length.
            dtype: the input's dtype.
        """
        return {op: n for op, n in self.work(d, dtype).items() if op != "check"}

    def decompress_work(self, d: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
        """The host work of one ``decompress`` (into a length-``d`` output, or added into one) of a payload of
        a length-``d`` input: as :meth:`work`; the default, one elementwise pass over the output.

        Args:
            d: the input's length.
            dtype: the input's dtype.
        """
        return {"elementwise": d}

    def hyper(self) -> dict:
        """The hyper-parameters this compressor was built with (for logging and ``repr``)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper().items())
        return f"{type(self).__name__}({args})"


def finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite (a non-float tensor always is): one Numba pass over a CPU
    float32/float64 tensor (:func:`._common.all_finite`), torch ops elsewhere."""
    return all_finite(x) if x.is_floating_point() else True
