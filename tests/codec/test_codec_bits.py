"""The bit layouts of ``codec.bits`` at the lengths where the fast kernels run (whole 4096-code blocks of
the lane layout, 8-code words) and their tails, against a reference written from the module docstring's
definition bit by bit (numpy, independent of the library's torch path); both the Numba and the torch
path, bit-exact round trips, unaligned receive buffers. Short lengths: tests/codec/test_wire_formats.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecomm.codec import bits as B

BLOCK = 4096


def reference_pack(codes: np.ndarray, k: int) -> np.ndarray:
    """Bit ``q`` of code ``i`` goes to one stream bit: in a lane block (k not in 1, 2, 4, 8, 16), bit
    ``t = r k + q`` of column ``c``'s stream (``i`` = row ``r``, column ``c`` of the W x 4096/W block),
    which is bit ``t % W`` of unit ``(t // W, c)`` of the k x 4096/W unit matrix; else bit ``k i + q``."""
    n = codes.size
    v = codes.astype(np.int64)
    w = 0 if k in (1, 2, 4, 8, 16) else (8 if k < 8 else 16)
    nblk = n // BLOCK if w else 0
    out = np.zeros((n * k + 7) // 8, dtype=np.uint8)
    q = np.arange(k)
    bit = (v[:, None] >> q) & 1                                    # (n, k)
    i = np.arange(n)
    pos = np.empty((n, k), dtype=np.int64)                         # absolute stream bit of each (i, q)
    if nblk:
        c_per = BLOCK // w
        b, r, c = i[: nblk * BLOCK] // BLOCK, (i[: nblk * BLOCK] % BLOCK) // c_per, i[: nblk * BLOCK] % c_per
        t = r[:, None] * k + q                                     # bit of the column's stream
        unit = (t // w) * c_per + c[:, None]                       # row-major in the k x c_per matrix
        pos[: nblk * BLOCK] = b[:, None] * (BLOCK * k) + unit * w + t % w
    tail = i[nblk * BLOCK:] - nblk * BLOCK
    pos[nblk * BLOCK:] = nblk * BLOCK * k + tail[:, None] * k + q
    sel = bit.reshape(-1) == 1
    p = pos.reshape(-1)[sel]
    np.bitwise_or.at(out, p // 8, (1 << (p % 8)).astype(np.uint8))
    return out


def _codes(n, k, dt, signed, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-(1 << (k - 1)), 1 << (k - 1)) if signed else (0, 1 << k)
    return torch.randint(lo, hi, (n,), generator=g).to(dt)


def _fits(k, dt, signed):
    bits = torch.iinfo(dt).bits
    return k <= bits and (signed or k < bits)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nblk=st.integers(0, 3), tail=st.sampled_from([0, 1, 7, 8, 63, 64, 65, 511, 4095]),
       k=st.integers(1, 16), dt=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64]),
       signed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_layout_and_round_trip_at_block_lengths(nblk, tail, k, dt, signed, seed):
    if not _fits(k, dt, signed):
        return
    n = nblk * BLOCK + tail
    c = _codes(n, k, dt, signed, seed)
    p = B.pack_bits(c, k)
    assert p.numel() == B.packed_nbytes(n, k)
    assert np.array_equal(p.numpy(), reference_pack(c.numpy(), k))
    assert torch.equal(B.unpack_bits(p, n, k, signed=signed, dtype=dt), c)


@pytest.mark.parametrize("k", [1, 3, 4, 5, 7, 9, 12, 15, 16])
def test_torch_path_same_bytes_at_block_lengths(k, monkeypatch):
    """The torch ops (the path CUDA tensors take) give the Numba path's bytes and invert them."""
    n = 2 * BLOCK + 77
    dt = torch.int8 if k <= 8 else torch.int16
    c = _codes(n, k, dt, True, k)
    p = B.pack_bits(c, k)
    monkeypatch.setattr(B, "_FORCE_TORCH", True)
    assert torch.equal(B.pack_bits(c, k), p)
    assert torch.equal(B.unpack_bits(p, n, k, dtype=dt), c)
    u = _codes(n, k, torch.int32, False, k + 1)
    assert torch.equal(B.unpack_bits(B.pack_bits(u, k), n, k, signed=False, dtype=torch.int32), u)


@pytest.mark.parametrize("k", [3, 6, 11])
def test_unaligned_receive_buffer(k):
    """A slot cut from a larger receive buffer at an odd byte offset unpacks the same."""
    n = BLOCK + 5
    c = _codes(n, k, torch.int16, True, 7)
    p = B.pack_bits(c, k)
    buf = torch.zeros(p.numel() + 3, dtype=torch.uint8)
    buf[3:] = p
    assert torch.equal(B.unpack_bits(buf[3:], n, k, dtype=torch.int16), c)


def test_extreme_codes_of_every_width():
    """The most negative and most positive code of each width, and all-ones unsigned codes, whole blocks."""
    for k in range(1, 17):
        dt = torch.int8 if k <= 8 else torch.int16
        lo, hi = -(1 << (k - 1)), (1 << (k - 1)) - 1
        c = torch.tensor([lo, hi] * (BLOCK // 2) + [lo, hi, 0], dtype=dt)
        p = B.pack_bits(c, k)
        assert np.array_equal(p.numpy(), reference_pack(c.numpy(), k)), k
        assert torch.equal(B.unpack_bits(p, c.numel(), k, dtype=dt), c), k
        if k < 16:
            u = torch.full((BLOCK + 3,), (1 << k) - 1, dtype=torch.int32)
            assert torch.equal(B.unpack_bits(B.pack_bits(u, k), u.numel(), k, signed=False, dtype=torch.int32), u)
