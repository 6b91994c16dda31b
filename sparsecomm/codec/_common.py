"""Argument checks and the numba/torch dispatch shared by the codec modules."""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels as _kernel_paths
from ..errors import CodecError

BACKENDS = ("auto", "numba", "torch")

#: float dtypes the numba kernels handle; anything else (float16, bfloat16) takes the torch path
NUMBA_FLOATS = (torch.float32, torch.float64)
NUMBA_INTS = (torch.int32, torch.int64)

#: unsigned view dtype and |x| mask (sign bit cleared) per float dtype, for the bit-pattern scan
BITS = {
    torch.float32: (np.uint32, np.uint32(0x7FFFFFFF)),
    torch.float64: (np.uint64, np.uint64(0x7FFFFFFFFFFFFFFF)),
}


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise CodecError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


def num_blocks(n: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` covering ``n`` elements: ``ceil(n / block_size)``."""
    block_size = check_block_size(block_size)
    if n < 0:
        raise CodecError(f"n must be non-negative, got {n}")
    return -(-int(n) // block_size)


def numba_eligible(*tensors: torch.Tensor) -> bool:
    """True if every tensor is on the CPU and contiguous (so ``tensor.numpy()`` is a zero-copy view)."""
    for t in tensors:
        if not (t.is_cpu and t.is_contiguous()):
            return False
    return True


def use_numba(backend: str, dtypes_ok: bool, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend``: numba for CPU contiguous tensors of a supported dtype, torch otherwise.

    On the hot path of every kernel call, so kept to a few attribute reads.
    """
    if backend == "auto":  # sparsecomm.kernels.force("torch") sends "auto" to torch (CI runs the GPU path)
        return dtypes_ok and not _kernel_paths.torch_forced() and numba_eligible(*tensors)
    if backend == "torch":
        return False
    if backend == "numba":
        if not (dtypes_ok and numba_eligible(*tensors)):
            what = ", ".join(f"{t.dtype} on {t.device} (contiguous={t.is_contiguous()})" for t in tensors)
            raise CodecError(f"backend='numba' needs contiguous CPU tensors of a supported dtype; got {what}")
        return True
    raise CodecError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")


def as_np(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat numpy view of a CPU contiguous tensor (autograd is not tracked)."""
    if t.dim() == 1 and not t.requires_grad:
        return t.numpy()  # the common case, without the two extra tensor objects
    return t.detach().reshape(-1).numpy()


def check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise CodecError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_mask(mask: torch.Tensor, nb: int, device: torch.device | None = None) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise CodecError(f"mask must be a 1-D torch.bool tensor, got {got}")
    if mask.numel() != nb:
        raise CodecError(f"mask has {mask.numel()} entries but the tensor has {nb} blocks")
    if device is not None and mask.device != device:
        raise CodecError(f"mask is on {mask.device} but the data is on {device}")
