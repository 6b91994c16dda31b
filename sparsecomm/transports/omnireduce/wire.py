"""OmniReduce wire formats and the block layout every endpoint derives from the call's header.

Layout (Fei et al., SIGCOMM'21, Sec. 3-4; sands-lab/omnireduce ``omnireduce-RDMA/omnireduce``): the
flat tensor of ``numel`` elements is cut into ``nb = ceil(numel / block_size)`` blocks. Aggregator
``a`` of ``A`` owns the contiguous range ``[a*nb//A, (a+1)*nb//A)``, split into ``channels``
contiguous sub-ranges (the paper's *slots*: independent self-clocked streams, so that one aggregator's
up- and downstream overlap). A channel of ``size`` blocks has ``L = min(size, lanes)`` lanes; its local
block ``j`` is in lane ``j % L`` at position ``j // L``. An aggregator's memory is a few messages of at
most ``L`` blocks per channel (its receive ring, :mod:`.window`, and its sums, double-buffered): bounded
by ``lanes``, not by the tensor nor by the number of workers.

Every message fuses one block per lane of a channel (the paper's block fusion). ``k`` blocks travel as
``[k x block_size values | pad to 4 bytes | int32 x k look-aheads]`` (a look-ahead is a channel-local
block index, ``size`` = none); the padding is zero, as are the bytes of a lane bitmap's last int32 word past
the bitmap: every byte on the wire is written (:func:`clear_pad`), none left as a pooled buffer held it:

* round 0, worker -> aggregator: a header (``int64[HDR]``: the call's description, checked for
  agreement, how many position-0 blocks the worker sends in each channel, so that the aggregator
  posts every round-0 receive as soon as the header is in, and a checksum) per aggregator; per channel,
  ``int32[L]``: the worker's first non-zero block of every
  lane (a bitmap when every lane has one block), then the worker's non-zero blocks at position 0 of
  their lane, with their look-aheads (position 0 is every lane's first pending block, so they can
  travel at once; no look-aheads when every lane has one block: they would all be "none", and a run
  of whole blocks then travels as it lies in the tensor, without a copy). The reference implementation sends position 0 of every lane, zero or not ("dense
  first round"); here only the non-zero ones travel and the metadata marks the rest.
* round 0, aggregator -> worker: a reply header (status, downstream dtype, error detail, and each
  channel's number of position-0 sums); per channel
  ``int32[L]``: each lane's next pending block, encoded ``-1 - next`` where the lane's position 0 was
  non-zero somewhere (a bitmap of those lanes when every lane has one block), then (if any) the sums
  of those position-0 blocks, in lane order.
* after a round-0 reply that is not OK, worker -> aggregator: the manifest (``int64[MAN]``: the bytes of
  each round-0 message the worker sent it, checksummed), by which the aggregator consumes them (never by
  the header, which may be the one that was wrong).
* round r >= 1, up: the lanes whose pending block this worker holds, with its next look-ahead in each.
* round r >= 1, down: the sums of every active lane's pending block, with each lane's next pending
  block (the minimum of the announced look-aheads).

The last block of a tensor whose length is not a multiple of ``block_size`` is short; it travels zero-padded,
but in a message of every block of a one-round channel and nothing else (round 0's blocks of a worker that
holds them all; the channel's sums, every block summed), which then is the tensor's range as it lies: there
the padding is left off (:func:`short_end`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from ...errors import MalformedMessage, MismatchError, OverflowError_, ProtocolError, SparseCommError  # noqa: F401
from ...fabric.base import express
from .._handshake import dtype_code as _hs_dtype_code

#: "OMNI" and the wire version: an aggregator rejects a header of another version (:func:`.header.validate_header`)
MAGIC = 0x4F4D4E49_0005
MAX_CHANNELS = 16
HDR = 12 + MAX_CHANNELS    # int64 fields: 12 scalars, then one count per channel (slot)
MAN = 2 + MAX_CHANNELS     # int64 fields of a manifest: first look-aheads' bytes, blocks' bytes per slot, checksum
# the admission's header and verdict are express (:func:`~sparsecomm.fabric.base.express`): a worker posts the
# receives of an aggregator's sums only once its verdict is in, which on a real fabric would otherwise be written
# behind the round-0 blocks its host's worker streams to the same peer; each one's receive is posted before its
# receiver sends that peer any data (the aggregator's header receives first of all; a worker's verdict receive
# right after its header)
TAG_HDR_UP = express(0x4F4F01)      # round-0 header, worker -> aggregator
TAG_HDR_DOWN = express(0x4F4F02)    # round-0 reply header, aggregator -> worker
TAG_FIRSTS = 0x4F4F03     # round-0 first look-aheads of every channel, worker -> aggregator
TAG_MANIFEST = 0x4F4F04   # after a verdict that is not OK: the worker's round-0 messages, worker -> aggregator


class Msg(IntEnum):
    """The messages of one call, in the order a channel's stream carries them."""

    HDR = 0        #: worker -> aggregator: the round-0 header (``int64[HDR]``), on ``TAG_HDR_UP``
    REPLY = 1      #: aggregator -> worker: the verdict (reply header), on ``TAG_HDR_DOWN``
    FIRSTS = 2     #: worker -> aggregator: every channel's first look-aheads, one message (on ``TAG_FIRSTS``)
    BLOCKS0 = 3    #: worker -> aggregator, per channel: its position-0 blocks
    WORDS = 4      #: aggregator -> worker, per channel: round-0 sums, then lane words (:func:`fused0`)
    SUMS0 = 5      #: aggregator -> worker, per channel, every block summed: the sums alone (:func:`tag_sums0`)
    UP = 6         #: worker -> aggregator, per channel, rounds >= 1: held blocks + look-aheads
    DOWN = 7       #: aggregator -> worker, per channel, rounds >= 1: sums + next pending blocks
    GO = 8         #: local only, colocated worker -> its hosted aggregator: its verdict is taken, start
    MANIFEST = 9   #: worker -> aggregator, after a verdict that is not OK: its round 0 (:func:`.header.manifest`)


class Key(NamedTuple):
    """A message's identity at the endpoint that receives it (its inbox key): the kind, the peer
    (the sending worker at an aggregator, the sending aggregator at a worker) and the channel slot
    (-1 for the per-aggregator headers). Receives of one peer's messages on one channel are posted in
    the order of :class:`Msg` (their tag's stream order)."""

    msg: Msg
    peer: int
    slot: int = -1


#: ``Key.new((msg, peer, slot))``: a key from its three fields, in one C call (:class:`Key`'s own constructor is a
#: Python function; a key is built per message)
Key.new = functools.partial(tuple.__new__, Key)


class Buf(NamedTuple):
    """The role of a pooled send buffer: message kind, peer (-1: shared by every peer), slot, and the
    round's parity (a channel's messages are double-buffered across rounds)."""

    msg: Msg
    peer: int = -1
    slot: int = -1
    parity: int = 0


#: ``Buf.new((msg, peer, slot, parity))``: a buffer's role from its four fields, in one C call (as :attr:`Key.new`)
Buf.new = functools.partial(tuple.__new__, Buf)


def tag_up(slot: int) -> int:
    """Tag of channel ``slot``'s worker -> aggregator stream (its rounds in order)."""
    return 0x4F5000 + slot


def tag_down(slot: int) -> int:
    """Tag of channel ``slot``'s aggregator -> worker stream (its rounds in order)."""
    return 0x4F6000 + slot


def tag_sums0(slot: int) -> int:
    """Tag of channel ``slot``'s round-0 sums when every block of it is summed (aggregator -> worker;
    the lane words are then implied, :func:`fused0`): received straight into the worker's result."""
    return 0x4F7000 + slot


WHAT = "omnireduce allreduce"

KINDS = ("dense", "aligned", "sparse", "quantized")

#: dtypes the protocol carries (floats summed as floats, integer codes exactly as integers)
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
)

# header fields (int64); those in AGREE must be equal on every worker
(F_MAGIC, F_NUMEL, F_DTYPE, F_BLOCK, F_AGGS, F_CHANNELS, F_LANES, F_KIND, F_CHECK, F_WORLD,
 F_ABSMAX, F_SUM) = range(12)
F_K0 = 12     # header[F_K0 + slot]: the worker's position-0 blocks in that channel (sizes its message)
FIELD_NAMES = {
    F_MAGIC: "wire_version", F_NUMEL: "numel", F_DTYPE: "dtype", F_BLOCK: "block_size",
    F_AGGS: "num_aggregators", F_CHANNELS: "channels", F_LANES: "lanes", F_KIND: "payload_kind",
    F_CHECK: "shared_indices_or_scale_fingerprint", F_WORLD: "world_size",
}
AGREE = tuple(FIELD_NAMES)
#: how an error message names the header's fields that are not compared
OTHER_NAMES = {F_ABSMAX: "integer_bound", F_SUM: "checksum",
               **{F_K0 + g: f"position-0 blocks of channel {g}" for g in range(MAX_CHANNELS)}}

# reply fields
R_STATUS, R_DOWN_DTYPE, R_FIELD, R_WMIN, R_VMIN, R_WMAX, R_VMAX = range(7)
R_K = 12      # reply[R_K + slot]: the channel's summed position-0 blocks (sizes its round-0 sums)
OK, MISMATCH, OVERFLOW, MALFORMED = 0, 1, 2, 3


def dtype_code(dt: torch.dtype) -> int:
    return _hs_dtype_code(dt)


_DTYPE_CODES = {_hs_dtype_code(d): d for d in DTYPES}


def code_dtype(code: int) -> torch.dtype:
    dt = _DTYPE_CODES.get(int(code))
    if dt is None:
        raise MalformedMessage(f"{WHAT}: dtype code {int(code)} is not a dtype the protocol carries")
    return dt


def accumulate_dtype(up: torch.dtype) -> torch.dtype:
    """The aggregator's adder: float64 for float64, float32 for narrower floats, int64 for codes."""
    if up.is_floating_point:
        return torch.float64 if up == torch.float64 else torch.float32
    return torch.int64


def down_dtype(up: torch.dtype, absmax_sum: int) -> torch.dtype:
    """Downstream dtype: floats travel back in their own dtype; integer codes in the narrowest signed
    integer that holds any sum (``|sum| <= sum over workers of max |code|``), so the sum is exact."""
    if up.is_floating_point:
        return up
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        if absmax_sum <= torch.iinfo(dt).max:
            return dt
    raise OverflowError_(f"integer sum bound {absmax_sum} does not fit in int64")


def pad4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


@dataclass(frozen=True)
class Channel:
    """One stream of an aggregator: blocks ``[lo, lo + size)``, ``lanes`` lanes; derived once (read per message):

    - ``single``: one block per lane (``lanes >= size``): round 0 is the whole stream, and the per-lane metadata
      of round 0 shrinks to one bit (a first look-ahead can only be "position 0" or "none"; the next pending
      block after round 0 is always "none");
    - ``meta_bytes``: bytes of its round-0 per-lane metadata (first look-aheads up, lane words down):
      ``ceil(lanes / 8)`` if ``single``, else ``4 lanes``;
    - ``words_ints``: the int32 words of tail a fused round-0 reply (:func:`fused0`) carries its lane words in,
      ``pad4(meta_bytes) // 4``."""

    agg: int
    slot: int
    lo: int
    size: int
    lanes: int
    single: bool = field(init=False, repr=False, compare=False)
    meta_bytes: int = field(init=False, repr=False, compare=False)
    words_ints: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        one = self.lanes >= self.size
        meta = -(-self.lanes // 8) if one else 4 * self.lanes
        object.__setattr__(self, "single", one)                 # (frozen: set once, here)
        object.__setattr__(self, "meta_bytes", meta)
        object.__setattr__(self, "words_ints", pad4(meta) // 4)


class Channels(tuple):
    """An aggregator's channels, in slot order (a tuple of :class:`Channel`), with what a call reads of them per
    message derived once, as attributes (no hash of the channels to look it up): ``singles``, the one-round
    channels; ``bitmap``, :func:`one_bitmap`."""

    def __new__(cls, chans=()) -> Channels:
        self = super().__new__(cls, chans)
        self.singles = tuple(ch for ch in self if ch.single)
        self.bitmap = one_bitmap(self)
        return self


@functools.lru_cache(maxsize=64)
def plan(numel: int, block_size: int, num_aggregators: int, channels: int,
         lanes: int) -> tuple[Channels, ...]:
    """The channels of every aggregator (empty channels dropped), in slot order (immutable: one plan is
    shared by every call, and every header, of the same shape)."""
    nb = -(-numel // block_size) if numel > 0 else 0
    out: list[tuple[Channel, ...]] = []
    for a in range(num_aggregators):
        lo, hi = a * nb // num_aggregators, (a + 1) * nb // num_aggregators
        m = hi - lo
        chans = []
        for g in range(channels):
            c_lo, c_hi = lo + g * m // channels, lo + (g + 1) * m // channels
            if c_hi > c_lo:
                chans.append(Channel(a, g, c_lo, c_hi - c_lo, min(c_hi - c_lo, lanes)))
        out.append(Channels(chans))
    return tuple(out)


def plan_from_header(h: np.ndarray) -> tuple[tuple[Channel, ...], ...]:
    return plan(int(h[F_NUMEL]), int(h[F_BLOCK]), int(h[F_AGGS]), int(h[F_CHANNELS]), int(h[F_LANES]))


def short_end(ch: Channel, numel: int, block_size: int) -> int:
    """The elements a message of every block of channel ``ch`` leaves off: the padding of the tensor's short
    last block, where ``ch`` is a one-round channel that ends with it (else 0). Such a message -- round 0's
    blocks of a worker that holds every block of the channel, the channel's sums alone (:func:`fused0`
    false) -- carries nothing else, so it is the tensor's range as it is: sent from the tensor and received
    into the result without a copy (gloo matches a message's size to its receive's, so the padding cannot
    be left to the receiver)."""
    return max(0, (ch.lo + ch.size) * block_size - numel) if ch.single else 0


def block_bytes(k: int, block_size: int, itemsize: int, extra: int = 0, meta: bool = True, short: int = 0) -> int:
    """Bytes of ``k`` blocks (padded to 4 bytes), ``k`` look-aheads (if ``meta``) and ``extra`` int32;
    ``short``: elements left off the last block (:func:`short_end`; a message of blocks alone)."""
    return -(-((k * block_size - short) * itemsize) // 4) * 4 + 4 * ((k if meta else 0) + extra)  # (pad4, inline)


#: the tail of a message of blocks alone (no look-aheads, no extra words): empty, one tensor shared by every such
#: message (:func:`split` makes no view for it; nothing can be written into it)
NO_TAIL = torch.empty(0, dtype=torch.int32)


def split(buf: torch.Tensor, k: int, block_size: int, dtype: torch.dtype, extra: int = 0,
          meta: bool = True, short: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a block message: ``(k, block_size)`` blocks and the ``int32`` tail (look-aheads, extra;
    :data:`NO_TAIL` where it has neither); ``short`` (:func:`short_end`, a message of blocks alone): the blocks
    as one flat run of ``k * block_size - short`` elements."""
    if short:
        return buf[:(k * block_size - short) * dtype.itemsize].view(dtype), NO_TAIL
    nd = k * block_size * dtype.itemsize
    data = buf[:nd].view(dtype).view(k, block_size)
    ints = (k if meta else 0) + extra
    if not ints:                    # (blocks alone: no view of an empty tail made, per message)
        return data, NO_TAIL
    lo = -(-nd // 4) * 4            # (pad4, inline: once per message)
    return data, buf[lo:lo + 4 * ints].view(torch.int32)


def message(pool, role, k: int, block_size: int, dtype: torch.dtype, extra: int = 0, meta: bool = True):
    """A block message in the send buffer of ``role`` of ``pool`` (a :class:`sparsecomm.fabric.roles.Pool`,
    reused once its sends have completed): ``(buffer, blocks view, int32 tail view)``, see :func:`split`.
    The padding between the blocks and the tail is zeroed (:func:`clear_pad`); the blocks and the tail are
    the builder's to write, every byte of them."""
    buf = pool.get(("out", role), block_bytes(k, block_size, dtype.itemsize, extra, meta))
    data, tail = split(buf, k, block_size, dtype, extra, meta)
    clear_pad(buf, k, block_size, dtype)
    return buf, data, tail


def clear_pad(buf: torch.Tensor, k: int, block_size: int, dtype: torch.dtype) -> None:
    """Zero the 1-3 bytes that pad ``k`` blocks of a message being built in ``buf`` to 4 bytes (where their
    bytes are not a multiple of 4: 1- and 2-byte elements, an odd block size). Nothing else writes them, and
    a buffer from a pool (``torch.empty``) holds whatever was there: sent as they are, they would leak the
    process's memory to the peer and make the wire differ from run to run."""
    nd = k * block_size * dtype.itemsize
    if nd % 4:
        buf[nd:-(-nd // 4) * 4].zero_()



def fused0(ch: Channel, k: int) -> bool:
    """Do a channel's ``k`` round-0 sums travel in the lane words' message (``k`` blocks, then the words
    padded to 4 bytes: ``ch.words_ints`` int32 of tail, see :func:`split`)? Yes unless every block of
    the channel is summed (then it has one block per lane, and the words, every lane summed and nothing
    following, are implied): then the sums alone, on :func:`tag_sums0` (so that a worker can receive
    them straight into its result). Either way one message per channel."""
    return k < ch.size




def encode_firsts(mine: np.ndarray, ch: Channel) -> torch.Tensor:
    """A worker's first non-zero block of every lane (``size`` = none): int32 per lane, or a bitmap
    of "position 0 is non-zero" when every lane has one block."""
    return torch.from_numpy(_firsts(mine, ch))


def _firsts(mine: np.ndarray, ch: Channel) -> np.ndarray:
    """:func:`encode_firsts`' bytes, as a numpy ``uint8`` array."""
    if ch.single:
        return np.packbits(mine < ch.size, bitorder="little")
    return mine.astype(np.int32).view(np.uint8)


def encode_all_firsts(mines: list[np.ndarray], chans: list[Channel]) -> torch.Tensor:
    """A worker's round-0 metadata to one aggregator (:func:`firsts_bytes`): :func:`encode_firsts` of each of
    ``chans`` (``mines``: the worker's first non-zero block of every lane of each), one after another, in one
    fresh tensor (joined in numpy: one tensor made per message, not one per channel and their join)."""
    parts = [_firsts(m, ch) for m, ch in zip(mines, chans)]
    return torch.from_numpy(parts[0] if not parts[1:] else np.concatenate(parts))


def one_bitmap(chans: tuple[Channel, ...]) -> bool:
    """Are the round-0 metadata of ``chans`` (an aggregator's channels, contiguous, in slot order: one
    :func:`encode_all_firsts` message) one bitmap of their whole block range? Yes where every channel has one
    block per lane and every one but the last fills whole bytes: the message is then the worker's block mask
    of the range packed (:func:`firsts_of_range`), read back by one unpack (:meth:`.aggregator.AggCall.prepare`)."""
    return (bool(chans) and all(ch.single for ch in chans) and all(ch.size % 8 == 0 for ch in chans[:-1])
            and all(p.lo + p.size == q.lo for p, q in zip(chans, chans[1:])))


def firsts_of_range(mask: np.ndarray, chans: tuple[Channel, ...]) -> torch.Tensor:
    """:func:`encode_all_firsts` of ``chans`` where :func:`one_bitmap` holds, from the worker's block mask
    (``mask``, bool, numpy): the same bytes in one pack of the range (a one-round lane's first block is
    position 0 exactly where its block is non-zero; each channel's bitmap ends on a byte, the last one's
    padding bits zero)."""
    return torch.from_numpy(np.packbits(mask[chans[0].lo: chans[-1].lo + chans[-1].size], bitorder="little"))


@functools.lru_cache(maxsize=64)
def no_firsts(nbytes: int) -> torch.Tensor:
    """:func:`firsts_of_range` of a range of ``nbytes * 8`` blocks or fewer in which the worker holds no non-zero
    block: ``nbytes`` zero bytes, one tensor shared by every such message of that size (a message is only read:
    sent, or handed to the hosted aggregator, which unpacks it; never write it)."""
    return torch.zeros(nbytes, dtype=torch.uint8)


def decode_firsts(part: np.ndarray, ch: Channel) -> np.ndarray:
    """:func:`encode_firsts` read back from ``part`` (``uint8``, a channel's part of the message,
    :func:`split_firsts`): the first non-zero block of every lane (``size``: none)."""
    if ch.single:
        bits = np.unpackbits(part, bitorder="little", count=ch.lanes).astype(bool)
        return np.where(bits, np.arange(ch.lanes), ch.size)
    return part.view(np.int32).astype(np.int64)   # (numpy: at any byte offset in the message)


def firsts_bytes(chans: list[Channel]) -> int:
    """Bytes of a worker's round-0 metadata to one aggregator: its channels' first look-aheads, one after
    another in slot order (:func:`encode_firsts`), one message."""
    return sum(ch.meta_bytes for ch in chans)


def split_firsts(buf: torch.Tensor, chans: list[Channel]) -> list[np.ndarray]:
    """Each channel's part of a :func:`firsts_bytes` message, as a numpy ``uint8`` view of ``buf`` (what
    :func:`decode_firsts` reads: numpy's slices, no tensor made per channel)."""
    out, off, b = [], 0, buf.numpy()
    for ch in chans:
        out.append(b[off: off + ch.meta_bytes])
        off += ch.meta_bytes
    return out


def encode_words(newc: np.ndarray, summed: np.ndarray, ch: Channel) -> torch.Tensor:
    """Round-0 reply per lane: its next pending block, as ``-1 - next`` where its position 0 was
    summed (int32); a bitmap of the summed lanes when every lane has one block (nothing follows)."""
    if ch.single:
        return torch.from_numpy(np.packbits(summed, bitorder="little"))
    return torch.from_numpy(np.where(summed, -1 - newc, newc).astype(np.int32)).view(torch.uint8)


def decode_words(buf: torch.Tensor, ch: Channel) -> tuple[np.ndarray, np.ndarray]:
    """``(next pending block per lane, summed lanes)``."""
    if ch.single:
        summed = np.unpackbits(buf.numpy(), bitorder="little", count=ch.lanes).astype(bool)
        return np.full(ch.lanes, ch.size, dtype=np.int64), summed
    w = buf.view(torch.int32).numpy().astype(np.int64)
    summed = w < 0
    return np.where(summed, -1 - w, w), summed
