"""The SimFabric's host model: the CPU time an endpoint spends on messages and on the work it does between them.

:class:`HostModel` is a table of rates; ``Network(host=HostModel(...))`` charges them to the endpoints'
modelled clocks (``host=None``, the default: no host cost, every modelled time as without this module):

- per message sent, ``send_message_s + nbytes * send_byte_s`` on the sender's clock before its NIC starts
  (:meth:`.sim_network.Endpoint.transmit`);
- per message taken by the application, ``recv_message_s + nbytes * recv_byte_s`` on the receiver's clock
  after the message's delivery (:meth:`.sim_network.Endpoint.taken`);
- or, with a table by message size (``message_cpu_s``, ``message_wait_s``: size in bytes -> seconds, the same
  sizes; interpolated linearly in bytes between them, the smallest's value below them, the last two's line beyond
  the largest), which replaces the four rates above: half of ``message_cpu_s`` per message sent, on the sender's
  clock before its NIC starts, and half per message taken, on the receiver's clock (the CPU time a process spends
  on an exchange, one message sent and one received: its threads' system calls, copies and bookkeeping), and
  ``message_wait_s`` between a message's delivery and the moment its receiver may take it, without its CPU (the
  rest of an exchange's time: the receiver's wake-up, the threads' hand-offs): a receiver waiting for the message
  pays it; one busy past it does not, so that a stream of messages in flight overlaps their waits where a
  ping-pong pays each; on a network whose hosts stream a message's bytes beside the link
  (``Network(host_streams=True)``, a NIC apart from the CPUs, as the netbed's), only the fixed parts
  (:meth:`HostModel.send_fixed_s`, ``recv_fixed_s``, ``wait_fixed_s``: the values at the table's smallest size, or
  the per-message rates) come before and after the wire, the rest is a stage of a pipeline with it
  (:mod:`.sim_network`);
- the work a transport declares with :meth:`sparsecomm.fabric.base.Fabric.host_work` (:data:`HOST_OPS`):
  ``"sum"``, elements added into an accumulator (``sum_element_s`` of their dtype); ``"scan"``, elements
  scanned for non-zero blocks (``scan_element_s``); ``"scan_zero"``, the elements of the zero blocks among them
  (``scan_zero_element_s``, on top of ``scan_element_s``: the scan settles a non-zero block at its first
  non-zero value and reads a zero block to its end, so that a dense range costs ``scan_element_s`` per element
  and an empty one the sum of the two); ``"switch_packet"``, packets run through a switch
  program (``switch_packet_s``); ``"switch_message"``, messages whose packets a switch program ran in one
  call (``switch_message_s``: the call into the compiled program, its lock and the replies' split, once
  per message whatever its packets); ``"sparse_switch_packet"``, ``"sparse_switch_value"``,
  ``"sparse_switch_result"`` and ``"sparse_switch_message"``, the sparse switch's program
  (:mod:`sparsecomm.transports.switchml.sparse.dataplane`, a compiled call per packet): packets it runs
  (``sparse_switch_packet_s``: a row taken from its message, parsed and run through the registers), the value
  packets among them (``sparse_switch_value_s``, on top: the vector added into its slot, or its minimum taken, with
  the overflow check; a skip has none), result rows it produces (``sparse_switch_result_s``: a completed round's
  multicast or a retransmission, its row built and packed into the replies) and messages it takes
  (``sparse_switch_message_s``: the burst's split into rows, the replies' set-up); ``"sparse_switch_round"``, the
  results a sparse switch's worker takes (``sparse_switch_round_s``: its work per result in
  :mod:`sparsecomm.transports.switchml.sparse.rounds` and, for the stream, :mod:`~sparsecomm.transports.switchml.sparse.stream`'s
  compiled call: the row's header read and matched, the slot's parity flipped, the lane's next packet built and
  queued); a model without one of these
  (``None``, the default, and a profile without it) charges what it charged before they existed: the dense
  switch's ``switch_packet_s`` per packet, its ``switch_message_s`` per message, nothing per value packet or
  result, nothing per worker's result; ``"copy"``, bytes copied (``copy_byte_s``: the ring's and ``native``'s
  work copy of the caller's input in a call that does not sum in place, the sparse switch's padded copy of it
  and of its sums, the DDP hook's fused call's concatenation of its buckets and copy back into them,
  ``DistributedOptimizer``'s gather of the gradients into its buckets); ``"fresh"``, bytes of a buffer a transport allocates afresh in a call (``fresh_byte_s`` per
  byte for a buffer of at least ``fresh_min_bytes``, nothing below: the first touch of its pages, beyond the
  copy or fill that writes them; glibc's allocator maps a buffer above its mmap threshold afresh on every
  allocation and unmaps it when it is freed, and a smaller one's pages go back to the kernel when a run of calls
  leaves enough free at the top of its heap, which the calibration measures on such a run: the mean per call):
  the ring's and ``native``'s work copy under a huge page, the integer switch's codes and sums, the sparse switch's
  temporaries, the allgather's sum; not OmniReduce's result buffers, kept from call to call; ``"fresh_advised"``,
  bytes of such a buffer that the transport advised as huge pages before its first touch
  (:mod:`sparsecomm.transports.buffers`: the ring's and ``native``'s work copy of at least a huge page, 2 MiB),
  charged ``fresh_advised_byte_s`` per byte from ``fresh_min_bytes`` on (a profile without that rate: half
  of ``copy_byte_s``, the kernel zeroing the huge pages with one write of each byte, where a copy reads and writes
  it); ``"fresh_later"`` and ``"fresh_touch"``, a fresh buffer whose pages a transport touches piecewise as
  its parts are written (the float switch's result, its chunks decoded into it as their results arrive, behind the
  link): the first, bytes of such a buffer, charges nothing and holds them (a buffer of at least
  ``fresh_min_bytes``; a smaller one is not fresh and is not held); the second, bytes of them written now, charges
  ``fresh_byte_s`` per byte of those held and uses them up (a SimFabric endpoint keeps the count:
  :meth:`.sim_network.Endpoint.host_work`);
  ``"span"``, blocks of the range a block-sparse worker covers (``span_block_s``: OmniReduce's per-block work
  beyond the scan's kernel, whatever the density -- its lanes' set-up and bookkeeping, the result's bitmap of
  written blocks --, charged as the worker scans each aggregator's range); ``"index"``, blocks moved by a block index
  (``index_block_s``: gathered into a message, added into the sums or written into the result at scattered
  rows -- the rows of an indexed copy, later checked row by row --, the sparse switch's result rows stacked and
  scattered into its results, beyond their bytes and sums; and the
  blocks OmniReduce's cached result zeroes after a call, those the call before it wrote and it did not, with their
  bytes as ``"move"``; a contiguous run of blocks is one copy and is not charged); ``"move"``, bytes of blocks copied between a
  block-sparse endpoint's tensors and its messages (``move_byte_s``: OmniReduce's blocks gathered into a message
  and its sums written into the result, a run of blocks or blocks by index, and the sparse switch's result rows
  stacked and scattered, on top of ``"index"``'s per-block part; a large tensor's blocks, beyond the last-level cache); ``"check"``, elements a finiteness guard reads
  (``check_element_s``: the pass over a float sum that proves it holds no NaN or Inf, :mod:`sparsecomm.transports.
  _guards`, in a transport that sums floats; the allgather counts its check among its ``"elementwise"``
  passes; and the pass over a compressed round's input: the non-finite rule's read of the bucket,
  :meth:`sparsecomm.pipeline.rounds.MethodRounds.poisoned`, and the sampled top-k's of its input); ``"call"``, one
  call of a transport (``call_s`` of the transport's name, charged by :meth:`sparsecomm.transports.base.Transport.run`
  on every worker as the call starts: the Python a call runs whatever its size -- its set-up, the workers'
  agreement, its rounds' bookkeeping -- beyond the messages, bytes, sums, scans and packets charged above;
  a transport not in ``call_s`` is charged nothing); ``"call_peer"``, the other workers of a call (``call_peer_s``
  of the transport's name per other worker, charged by :meth:`sparsecomm.transports.base.Transport.run` on every
  worker beside ``"call"``: the part of a call's Python that grows with its workers -- OmniReduce's channels and
  lanes set up and walked for each aggregator and, at an aggregator, each worker's state; the allgather's
  headers, payloads and sum terms per peer --, so that a call of ``n`` workers costs ``call_s + (n - 1) *
  call_peer_s``; a transport not in ``call_peer_s``, the default and a profile without it, is charged nothing:
  its call costs ``call_s`` at any size of world, as before the rate existed);
- the encode and decode of a method and its compressor (:meth:`sparsecomm.methods.base.Method.work`, which
  :mod:`sparsecomm.pipeline.rounds` charges on a fabric with modelled time around each call it makes, in these
  operations): ``"elementwise"``, elements through an elementwise pass (``elementwise_element_s``: an add, a
  copy, a division, a cast, a finiteness check; the allgather transport declares its sum's too: the result
  zeroed and checked, each worker's values added; and the sparse switch its result's: zeroed, the union's sums
  decoded); ``"select"``, elements a top-k selection runs over
  (``select_element_s``: the partial sort among candidates); ``"sample"``, magnitudes a top-k draws at random
  positions for its threshold (``sample_element_s``); ``"collect"``, elements the sampled top-k's candidate pass
  reads (``collect_element_s``: :func:`sparsecomm.compressors.topk.collect_ge`, each magnitude compared with the
  threshold and its index stored, a store-then-advance loop that takes longer per element than an elementwise
  pass; ``None``, a profile without it: the elementwise pass's rate and contention, its charge before the rate
  existed); ``"matmul"``, multiply-adds of a product of the large matrix
  with a skinny factor (``matmul_mac_s``: PowerSGD's ``M Q``); ``"matmul_t"``, multiply-adds of one
  of its transpose (``matmul_t_mac_s``: PowerSGD's ``M^T P``, as :func:`sparsecomm.methods.powersgd.factor_product`
  computes it); ``"matmul_outer"``, multiply-adds of a product of two skinny factors into a large matrix
  (``matmul_outer_mac_s``: PowerSGD's estimate ``P Q^T``, which writes the n x m matrix where the other two read
  it; ``None``, a profile without it: ``matmul_mac_s``, its charge before the rate existed); ``"kernel"``, calls
  whose fixed cost counts (``kernel_call_s``: a method call's Python, a thin QR, a top-k's set-up). Every rate 0
  (the default, and a profile without them): no charge, the modelled times as without them. ``codec_contention``
  (operation -> factor, at least 1) multiplies the rate of each operation it names: how many times longer the
  operation's kernel takes when every core of the machine runs one at once, as the workers of a bulk-synchronous
  step run their encodes and decodes together, against the kernel alone, as its rate is measured (the cores share
  the last-level cache and the memory bus: a product that streams a gradient's matrix through them takes longer
  while the other cores stream theirs). It is the machine's, measured with every core busy
  (:func:`sparsecomm.netbed.calibrate.contention_costs`), for runs whose endpoints keep every core busy (the
  netbed's hosts on the machine that measured it; fewer busy endpoints than cores would see less of it). An
  operation not in it (the default: empty, and a profile without it) is charged its rate alone, as before it
  existed.

A model that charges a fixed CPU time per message (``send_message_s + recv_message_s > 0``, or a table by
message size) is a host
whose messages want to be long, as a real fabric's are: the SimFabric then declares the real fabric's
``message_bytes`` (:attr:`.sim.SimFabric.message_bytes`), so the transports take a real fabric's defaults
(the switches' packets travel as bursts of up to 1 MiB, one message per burst, as long as its packets, with no
retransmission timer, as they do over gloo), and a receive takes a shorter message into a prefix of its buffer,
as gloo's does. A model without one keeps the SimFabric's (the papers' one packet per datagram).

Every charge is multiplied by the endpoint's CPU factor (:meth:`HostModel.factor`): its ``cpu_share`` (how
many times longer its CPU work takes because it shares cores with other busy endpoints: 4 hosts on 2 cores
is ``cpu_share=2``) times its straggler factor (``Network.stragglers``, a slow host). The share is a fixed
stretch, exact when the endpoints sharing the cores are busy at the same moments (the workers of a
bulk-synchronous collective doing the same step) and an over-estimate when one of them would have the cores
to itself; the model has no scheduler of its own. ``Fabric.compute(s)`` is the caller's figure and is not
stretched by the share.

The stretch is one factor for every rate, and a machine's costs do not all grow alike when its processes
outnumber its cores: gloo's all-reduce, C++ on threads that wait in the kernel much of the time, takes less than
twice as long with two processes per core as with one, where the library's Python messages take longer. A model may
therefore hold rates fitted where the processes shared the cores (``by_share``: share -> the rates of
:data:`SHARED_RATES` fitted with that many processes per core, :func:`sparsecomm.netbed.calibrate.shared_costs`):
:meth:`HostModel.sharing` takes the entry of the largest share not above the run's, in place of the model's own
rates (``call_s`` per transport: the entry's transports replace the model's, the others are kept), and stretches
them by the run's share as it stretches every rate (each entry's rates are fitted with that stretch in the model,
so that at its own share it gives back what was measured; at a larger share it is stretched on as today). A run
whose share has no entry at or below it (a share of 1, and every run of a model without the table, the default and
a profile without it) takes the model's own rates, stretched: the modelled times as before the table existed. The
table is keyed by the model's ``cpu_share``, the run's processes per core; ``cpu_share_by_endpoint`` picks no
rates.

The share is a mean, and a collective waits for its last worker. Where endpoints outnumber the cores, the
scheduler hands the cores out in slices, and a woken thread (a rank leaving a collective, gloo's I/O and worker
threads, a hook's hand-off to its communication thread) waits for a slice when the cores are busy: the workers
reach the next call at spread times, however equal their work, and every call starts when the last of them
arrives, where the modelled workers, stretched alike, arrive together. ``sync_s`` is that wait, per call of a
transport (``"sync"``, charged by :meth:`sparsecomm.transports.base.Transport.run` on every worker as the call
starts, before ``"call"``) per unit of share above 1 (:meth:`HostModel.sync_wait_s`: a share of 2, ``sync_s``;
cores of one's own, none), not stretched again by the CPU factor: measured on workers that alternate CPU work
and a small call on shared cores (:func:`sparsecomm.netbed.calibrate.sync_costs`), it is the time their loop
takes beyond its work stretched by the share and the call as modelled. 0 (the default, and a profile without
it): no wait, the modelled times as before it existed. The spread it waits out is the unequal progress of the
workers' work since they last met, so a call right after another (a method's next round after a short encode, a
second bucket's call queued behind the first) has little of it: with ``sync_work_s`` (the work per call of the
loop ``sync_s`` was measured on) a call waits ``min(1, w / sync_work_s)`` of it, ``w`` the endpoint's CPU since
its previous call ended (``"settle"``, charged by ``Transport.run`` as a call ends) over its share: its charged
host work and its :meth:`~sparsecomm.fabric.sim.sim.SimFabric.compute`. The two ends are measured: the calls
``call_s`` is fitted on run back to back and wait nothing beyond it, the loop's waits all of ``sync_s``; between
them the wait is taken to grow linearly with the work. ``sync_work_s`` ``None`` (the default, and a profile
without it): every call waits all of it.

The messages of the fabric's native collective (``torch.distributed``'s all-reduce over gloo: a ring whose sends,
receives and waits run in C++ on gloo's own threads, with no Python per message), as a model of it sends them
(:class:`sparsecomm.transports.native.model.GlooRing`, inside :meth:`sparsecomm.fabric.base.Fabric.native_messages`),
cost ``native_message_s`` per message and ``native_byte_s`` per byte on each side, in place of the message costs
above (:meth:`HostModel.native_messages`; fitted by :func:`sparsecomm.netbed.calibrate.native_costs` on
``dist.all_reduce``'s own calls). ``None`` (the default, and a profile without them): those messages cost the message
costs above, the library's own, as every message did before the rates existed.

All rates default to zero (a model that charges nothing); :func:`sparsecomm.netbed.calibrate.calibrate`
measures this machine's (``python -m sparsecomm.netbed calibrate --out host.json``) and
:meth:`.sim_network.Network.from_profile` loads them.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from ...errors import InvalidTypeError, InvalidValueError
from ...validate import check_int, check_real

__all__ = ["CODEC_RATES", "DERIVED_RATES", "FALLBACK_OPS", "FALLBACK_RATES", "HOST_OPS", "HostModel",
           "MESSAGE_TABLES", "NATIVE_RATES", "OPTIONAL_RATES", "SHARED_RATES", "SIZES", "SUM_DTYPES", "RATE_UNITS"]

#: the operations of :meth:`sparsecomm.fabric.base.Fabric.host_work` and the unit they count
HOST_OPS = {"sum": "element", "scan": "element", "switch_packet": "packet", "switch_message": "message",
            "copy": "byte", "fresh": "byte", "call": "call", "span": "block", "index": "block",
            "scan_zero": "element", "move": "byte", "check": "element",
            "elementwise": "element", "select": "element", "sample": "element", "matmul": "multiply-add",
            "matmul_t": "multiply-add", "matmul_outer": "multiply-add", "kernel": "call", "sparse_switch_packet": "packet",
            "sparse_switch_value": "packet", "sparse_switch_result": "packet", "sparse_switch_message": "message",
            "sparse_switch_round": "packet", "fresh_later": "byte", "fresh_touch": "byte",
            "call_peer": "peer", "sync": "call", "fresh_advised": "byte", "settle": "call", "collect": "element"}

#: the operations of a method's encode and decode (:meth:`sparsecomm.methods.base.Method.work`) and their rates
CODEC_RATES = {"elementwise": "elementwise_element_s", "select": "select_element_s", "sample": "sample_element_s",
               "matmul": "matmul_mac_s", "matmul_t": "matmul_t_mac_s", "matmul_outer": "matmul_outer_mac_s",
               "kernel": "kernel_call_s", "collect": "collect_element_s"}

#: the dtypes whose per-element sum cost a profile gives (:func:`sparsecomm.netbed.calibrate.calibrate` measures each)
SUM_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")

#: each rate of :class:`HostModel` and its unit (the profile's ``"unit"`` fields), and ``fresh_min_bytes``, the
#: size (bytes, an integer) from which ``fresh_byte_s`` is charged
RATE_UNITS = {
    "send_message_s": "s/message",
    "recv_message_s": "s/message",
    "send_byte_s": "s/byte",
    "recv_byte_s": "s/byte",
    "copy_byte_s": "s/byte",
    "fresh_byte_s": "s/byte",
    "fresh_min_bytes": "byte",
    "fresh_advised_byte_s": "s/byte",
    "sum_element_s": "s/element",
    "scan_element_s": "s/element",
    "scan_zero_element_s": "s/element",
    "switch_packet_s": "s/packet",
    "switch_message_s": "s/message",
    "span_block_s": "s/block",
    "index_block_s": "s/block",
    "move_byte_s": "s/byte",
    "check_element_s": "s/element",
    "call_s": "s/call",
    "elementwise_element_s": "s/element",
    "select_element_s": "s/element",
    "sample_element_s": "s/element",
    "matmul_mac_s": "s/multiply-add",
    "matmul_t_mac_s": "s/multiply-add",
    "matmul_outer_mac_s": "s/multiply-add",
    "kernel_call_s": "s/call",
    "collect_element_s": "s/element",
    "sparse_switch_packet_s": "s/packet",
    "sparse_switch_value_s": "s/packet",
    "sparse_switch_result_s": "s/packet",
    "sparse_switch_message_s": "s/message",
    "sparse_switch_round_s": "s/packet",
    "message_cpu_s": "s/message",
    "message_wait_s": "s/message",
    "codec_contention": "factor",
    "call_peer_s": "s/peer",
    "sync_s": "s/call",
    "sync_work_s": "s",
    "native_message_s": "s/message",
    "native_byte_s": "s/byte",
}

#: the rates that are tables by message size (bytes -> seconds), both or neither given, with the same sizes
MESSAGE_TABLES = ("message_cpu_s", "message_wait_s")

#: the rates that may be ``None`` (absent from a profile): each charges, when ``None``, the rate it names here
#: (``None``: nothing), the charge its operation had before the rate existed
FALLBACK_RATES = {"sparse_switch_packet_s": "switch_packet_s", "sparse_switch_value_s": None,
                  "sparse_switch_result_s": None,
                  "sparse_switch_message_s": "switch_message_s", "sparse_switch_round_s": None,
                  "matmul_outer_mac_s": "matmul_mac_s", "collect_element_s": "elementwise_element_s"}

#: the operations of :data:`CODEC_RATES` whose rate, when ``None``, falls back to another operation's whole charge,
#: its ``codec_contention`` factor too (the charge the operation had before its rate existed, when it was counted
#: as that operation); the others of :data:`FALLBACK_RATES` keep their own factor
FALLBACK_OPS = {"collect": "elementwise"}

#: the message costs of the fabric's native collective (gloo's own ring all-reduce, C++: no Python per message), which
#: :meth:`HostModel.native_messages` charges the messages sent and taken inside ``Fabric.native_messages()``: both
#: or neither (``None``, the default and a profile without them: those messages cost the model's own message rates,
#: as every message did before they existed)
NATIVE_RATES = ("native_message_s", "native_byte_s")

#: the rates a version-2 profile may lack (added within version 2; absent: 0, or for those of :data:`FALLBACK_RATES`
#: ``None``: the time the profile modelled)
OPTIONAL_RATES = ("span_block_s", "index_block_s", *CODEC_RATES.values(), "fresh_byte_s", "fresh_min_bytes",
                  "fresh_advised_byte_s",
                  "move_byte_s", "check_element_s", "scan_zero_element_s", *FALLBACK_RATES, *MESSAGE_TABLES,
                  "codec_contention", "call_peer_s", "sync_s", "sync_work_s", *NATIVE_RATES)

#: the rates that may be ``None`` (absent from a profile) beside :data:`FALLBACK_RATES`, each with its own charge
#: when ``None``: ``fresh_advised_byte_s``, half of ``copy_byte_s`` (:meth:`HostModel.work_s`); ``sync_work_s``, every
#: call waits all of its ``sync_s`` whatever the work before it (:meth:`HostModel.sync_wait_s`)
DERIVED_RATES = ("fresh_advised_byte_s", "sync_work_s")

#: the entries of :data:`RATE_UNITS` that are sizes in bytes (integers), not rates
SIZES = ("fresh_min_bytes",)

#: the rates a model may hold per share of the cores (:attr:`HostModel.by_share`, module docstring): those whose cost
#: with more processes than cores is not the one-core cost stretched by the share, as
#: :func:`sparsecomm.netbed.calibrate.shared_costs` fits them (the library's messages by size, gloo's native
#: messages, the per-call costs); the message tables both or neither, the native rates both or neither
SHARED_RATES = ("message_cpu_s", "message_wait_s", "native_message_s", "native_byte_s", "call_s")


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float32`` -> ``"float32"`` (a string is returned as it is)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class HostModel:
    """Per-operation CPU costs of every endpoint of a SimFabric run (the module docstring says where each is
    charged). Rates are seconds per unit (:data:`RATE_UNITS`), all zero by default.

    Args:
        send_message_s: CPU seconds per message sent (system calls, the transport's bookkeeping).
        recv_message_s: CPU seconds per message taken by the receiving application.
        send_byte_s: CPU seconds per byte sent (the copies into the network stack).
        recv_byte_s: CPU seconds per byte received.
        copy_byte_s: seconds per byte of a ``host_work("copy", nbytes)``.
        fresh_byte_s: seconds per byte of a ``host_work("fresh", nbytes)`` of at least ``fresh_min_bytes``: the
            first touch of a freshly allocated buffer's pages.
        fresh_min_bytes: the size (bytes) from which a fresh buffer is charged ``fresh_byte_s`` (smaller
            ones: nothing; 0: every size), and an advised one ``fresh_advised_byte_s``.
        fresh_advised_byte_s: seconds per byte of a ``host_work("fresh_advised", nbytes)`` of at least
            ``fresh_min_bytes``: the first touch of a fresh buffer advised as huge pages
            (:mod:`sparsecomm.transports.buffers`), the kernel's zeroing of its huge pages (``None``, a profile
            without it: half of ``copy_byte_s``, one write of each byte where a copy reads and writes it).
        sum_element_s: dtype name (:data:`SUM_DTYPES`, or any other ``torch`` dtype's name) -> seconds per
            element added (default: 0 for each of :data:`SUM_DTYPES`); a ``host_work("sum", ...)`` of a dtype
            not in it raises.
        scan_element_s: seconds per element scanned for non-zero blocks (OmniReduce's block scan).
        scan_zero_element_s: seconds per element of a zero block scanned, on top of ``scan_element_s``.
        switch_packet_s: seconds per packet run through a switch program (SwitchML's dataplane).
        switch_message_s: seconds per message whose packets a switch program runs (one call of the program
            per message, whatever its packets).
        span_block_s: seconds per block of the range a block-sparse worker covers (``host_work("span", blocks)``).
        index_block_s: seconds per block moved by a block index (``host_work("index", blocks)``).
        move_byte_s: seconds per byte of blocks copied between a block-sparse endpoint's tensors and its
            messages (``host_work("move", nbytes)``).
        check_element_s: seconds per element a finiteness guard reads (``host_work("check", elements)``).
        elementwise_element_s: seconds per element of an elementwise pass of a method or compressor.
        select_element_s: seconds per element a top-k selection runs over.
        sample_element_s: seconds per magnitude a top-k samples for its threshold.
        matmul_mac_s: seconds per multiply-add of a product of a large matrix with a skinny factor.
        matmul_t_mac_s: seconds per multiply-add of a product of a large matrix's transpose with a skinny factor.
        matmul_outer_mac_s: seconds per multiply-add of a product of two skinny factors written into a large
            matrix (``None``: ``matmul_mac_s``).
        kernel_call_s: seconds per call of a method's or compressor's kernel whose fixed cost counts.
        collect_element_s: seconds per element of the sampled top-k's candidate pass (``None``: the elementwise
            pass's charge, ``elementwise_element_s`` times its ``codec_contention`` factor).
        sparse_switch_packet_s: seconds per packet the sparse switch's program runs (``None``: ``switch_packet_s``).
        sparse_switch_value_s: seconds per value packet (not a skip) the sparse switch's program runs, on top of
            ``sparse_switch_packet_s`` (``None``: 0).
        sparse_switch_result_s: seconds per result row the sparse switch's program produces (``None``: 0).
        sparse_switch_message_s: seconds per message the sparse switch's program takes (``None``:
            ``switch_message_s``).
        sparse_switch_round_s: seconds per result a sparse switch's worker takes (``None``: 0).
        message_cpu_s: message size (bytes) -> the CPU seconds one endpoint spends on an exchange of messages of
            that size (one sent, one received), or empty (the default): the four message rates above instead
            (module docstring).
        message_wait_s: message size (bytes) -> the seconds of such an exchange beyond its CPU time, the wait
            between a message's delivery and its take; the sizes of ``message_cpu_s`` (both empty, or neither).
        call_s: transport name (``"ring"``, ``"omnireduce"``, ...) -> seconds per call of it, on every
            worker (default: none; a transport not in it is charged nothing).
        codec_contention: operation of :data:`CODEC_RATES` (``"matmul"``, ...) -> the factor (>= 1) its rate is
            charged at, the kernel's slowdown with every core busy (module docstring; default: none, each rate
            as it is).
        call_peer_s: transport name -> seconds per call of it per other worker of the call, on every worker,
            beside ``call_s`` (default: none; a transport not in it is charged ``call_s`` alone).
        sync_s: seconds a worker waits, per call of a transport, for the last worker of the call when the
            endpoints outnumber the cores, per unit of ``cpu_share`` above 1 (:meth:`sync_wait_s`; default 0:
            none).
        sync_work_s: the single-core CPU seconds of work each worker did before each call where ``sync_s`` was
            measured (:func:`sparsecomm.netbed.calibrate.sync_costs`): a call after less work since the endpoint's
            previous call ended waits that fraction of ``sync_s`` (:meth:`sync_wait_s`; ``None``, the default
            and a profile without it: every call waits all of it, as before it existed).
        native_message_s: CPU seconds per message of the fabric's native collective (gloo's ring all-reduce,
            modelled by :class:`sparsecomm.transports.native.model.GlooRing`), on the sender before its NIC starts
            and on the receiver as it takes it, in place of the model's own message costs (:meth:`native_messages`;
            ``None``, the default: the model's own message costs).
        native_byte_s: CPU seconds per byte of such a message, on each side (with ``native_message_s``: both or
            neither).
        by_share: share of the cores (> 1: processes per core) -> rates of :data:`SHARED_RATES` fitted with that
            many processes per core, which :meth:`sharing` puts in place of the model's own (module docstring;
            default: none, every share the model's own rates stretched).
        cpu_share: the CPU stretch of every endpoint (>= 1): endpoints sharing cores, e.g. 2 for 4 hosts on
            2 cores (:meth:`sharing`).
        cpu_share_by_endpoint: endpoint id -> its own stretch (>= 1), overriding ``cpu_share``.
    """

    send_message_s: float = 0.0
    recv_message_s: float = 0.0
    send_byte_s: float = 0.0
    recv_byte_s: float = 0.0
    copy_byte_s: float = 0.0
    fresh_byte_s: float = 0.0
    fresh_min_bytes: int = 0
    fresh_advised_byte_s: float | None = None
    sum_element_s: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(SUM_DTYPES, 0.0))
    scan_element_s: float = 0.0
    scan_zero_element_s: float = 0.0
    switch_packet_s: float = 0.0
    switch_message_s: float = 0.0
    span_block_s: float = 0.0
    index_block_s: float = 0.0
    move_byte_s: float = 0.0
    check_element_s: float = 0.0
    call_s: Mapping[str, float] = field(default_factory=dict)
    elementwise_element_s: float = 0.0
    select_element_s: float = 0.0
    sample_element_s: float = 0.0
    matmul_mac_s: float = 0.0
    matmul_t_mac_s: float = 0.0
    matmul_outer_mac_s: float | None = None
    kernel_call_s: float = 0.0
    collect_element_s: float | None = None
    sparse_switch_packet_s: float | None = None
    sparse_switch_value_s: float | None = None
    sparse_switch_result_s: float | None = None
    sparse_switch_message_s: float | None = None
    sparse_switch_round_s: float | None = None
    message_cpu_s: Mapping[int, float] = field(default_factory=dict)
    message_wait_s: Mapping[int, float] = field(default_factory=dict)
    codec_contention: Mapping[str, float] = field(default_factory=dict)
    call_peer_s: Mapping[str, float] = field(default_factory=dict)
    sync_s: float = 0.0
    sync_work_s: float | None = None
    native_message_s: float | None = None
    native_byte_s: float | None = None
    by_share: Mapping[float, Mapping[str, object]] = field(default_factory=dict)
    cpu_share: float = 1.0
    cpu_share_by_endpoint: Mapping[int, float] = field(default_factory=dict)
    # (not fields: the message tables as interpolation points, (sizes, CPU, waits), and the charges looked up per
    # size, set by __post_init__)
    _points = ((), (), ())
    _looked_up = None
    _native = None

    def __post_init__(self) -> None:
        who = "HostModel"
        put = object.__setattr__
        for name in RATE_UNITS:
            if name in (*FALLBACK_RATES, *NATIVE_RATES, *DERIVED_RATES) and getattr(self, name) is None:
                continue
            if name in SIZES:
                put(self, name, check_int(name, getattr(self, name), low=0, what=who))
            elif name not in ("sum_element_s", "call_s", "codec_contention", "call_peer_s", *MESSAGE_TABLES):
                put(self, name, check_real(name, getattr(self, name), low=0.0, what=who))
        if not isinstance(self.sum_element_s, Mapping):
            raise InvalidTypeError(f"{who}: sum_element_s must map dtype names to seconds per element, got "
                                   f"{type(self.sum_element_s).__name__}")
        sums = {}
        for k, v in self.sum_element_s.items():
            name = dtype_name(k)
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise InvalidValueError(f"{who}: sum_element_s has key {k!r}, which is no torch dtype (e.g. "
                                        f"{', '.join(SUM_DTYPES)})")
            sums[name] = check_real(f"sum_element_s[{name!r}]", v, low=0.0, what=who)
        put(self, "sum_element_s", MappingProxyType(sums))
        put(self, "call_s", MappingProxyType(_per_transport(self.call_s, "call_s", "seconds per call", who)))
        if not isinstance(self.codec_contention, Mapping):
            raise InvalidTypeError(f"{who}: codec_contention must map operations ({', '.join(CODEC_RATES)}) to "
                                   f"factors, got {type(self.codec_contention).__name__}")
        factors = {}
        for k, v in self.codec_contention.items():
            if k not in CODEC_RATES:
                raise InvalidValueError(f"{who}: codec_contention has key {k!r}; its keys are the operations "
                                        f"{', '.join(CODEC_RATES)}")
            factors[k] = check_real(f"codec_contention[{k!r}]", v, low=1.0, what=who)
        put(self, "codec_contention", MappingProxyType(factors))
        put(self, "call_peer_s", MappingProxyType(_per_transport(self.call_peer_s, "call_peer_s",
                                                                 "seconds per call per other worker", who)))
        tables = {}
        for name in MESSAGE_TABLES:
            table = getattr(self, name)
            if not isinstance(table, Mapping):
                raise InvalidTypeError(f"{who}: {name} must map message sizes (bytes) to seconds, got "
                                       f"{type(table).__name__}")
            tables[name] = {check_int(f"a message size of {name}", n, low=1, what=who):
                            check_real(f"{name}[{n}]", v, low=0.0, what=who) for n, v in table.items()}
            put(self, name, MappingProxyType(dict(sorted(tables[name].items()))))
        if set(tables["message_cpu_s"]) != set(tables["message_wait_s"]):
            raise InvalidValueError(f"{who}: message_cpu_s and message_wait_s must give the same message sizes, got "
                                    f"{sorted(tables['message_cpu_s'])} and {sorted(tables['message_wait_s'])}")
        # (the tables as interpolation points, and per size the charges already looked up: send_s, wait_s)
        put(self, "_points", (tuple(self.message_cpu_s), tuple(self.message_cpu_s.values()),
                              tuple(self.message_wait_s.values())))
        put(self, "_looked_up", {})
        if (self.native_message_s is None) != (self.native_byte_s is None):
            raise InvalidValueError(f"{who}: native_message_s and native_byte_s are given both or neither (None: the "
                                    f"native collective's messages cost the model's own message rates), got "
                                    f"{self.native_message_s!r} and {self.native_byte_s!r}")
        put(self, "_native", None)
        put(self, "by_share", _shared_entries(self.by_share, who))
        put(self, "cpu_share", check_real("cpu_share", self.cpu_share, low=1.0, what=who))
        put(self, "cpu_share_by_endpoint", MappingProxyType(
            {check_int("an endpoint of cpu_share_by_endpoint", e, low=0, what=who):
             check_real(f"cpu_share_by_endpoint[{e}]", f, low=1.0, what=who)
             for e, f in self.cpu_share_by_endpoint.items()}))

    def _fields(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __reduce__(self):
        return _rebuild, (self._fields(),)

    def __hash__(self) -> int:
        return hash(_frozen(self._fields()))

    def sharing(self, endpoints: int, cores: float) -> "HostModel":
        """This model with ``cpu_share = max(1, endpoints / cores)``: ``endpoints`` busy endpoints on
        ``cores`` cores (a netbed of 4 hosts on 2 cores: ``sharing(4, 2)``, a share of 2), and with the rates of
        its ``by_share`` entry of the largest share not above that one, if any, in place of its own (module
        docstring). Where it applies an entry, the model returned holds those rates as its own and no table
        (``by_share`` empty): the table is applied once, to a profile's model."""
        endpoints = check_int("endpoints", endpoints, low=1, what="HostModel.sharing")
        cores = check_real("cores", cores, low=0.0, low_open=True, what="HostModel.sharing")
        share = max(1.0, endpoints / cores)
        below = [s for s in self.by_share if s <= share]
        if not below:
            return dataclasses.replace(self, cpu_share=share)
        rates = dict(self.by_share[max(below)])
        if "call_s" in rates:
            rates["call_s"] = {**self.call_s, **rates["call_s"]}
        return dataclasses.replace(self, cpu_share=share, by_share={}, **rates)

    def factor(self, endpoint: int) -> float:
        """The CPU stretch of ``endpoint`` (its ``cpu_share_by_endpoint`` entry, else ``cpu_share``)."""
        return self.cpu_share_by_endpoint.get(endpoint, self.cpu_share)

    def native_messages(self) -> "HostModel":
        """The model that charges the messages of the fabric's native collective (``Fabric.native_messages()``:
        gloo's ring all-reduce, whose sends, receives and waits are C++ on gloo's own threads, with no Python per
        message): this one with its message costs ``native_message_s`` per message and ``native_byte_s`` per
        byte on each side (the four linear rates, no table by size and so no wait of a message beyond its CPU:
        the fitted rates hold all of it), every other rate its own; itself where they are ``None`` (the model's
        own message costs)."""
        if self.native_message_s is None:
            return self
        got = self._native
        if got is None:
            m, b = self.native_message_s, self.native_byte_s
            got = dataclasses.replace(self, send_message_s=m, recv_message_s=m, send_byte_s=b, recv_byte_s=b,
                                      message_cpu_s={}, message_wait_s={})
            object.__setattr__(self, "_native", got)
        return got

    def sync_wait_s(self, endpoint: int, work_s: float | None = None) -> float:
        """Seconds ``endpoint`` waits for a call's last worker: ``sync_s * (share - 1)``, its share of the cores
        (:meth:`factor`, not its straggler factor) above 1 (module docstring), times ``min(1, work_s /
        sync_work_s)`` where both are known: ``work_s``, the single-core CPU seconds of work the endpoint did since
        its previous call ended (a call right after another has no unequal work behind it to wait out: the calls
        ``call_s`` is fitted on run back to back and wait nothing beyond it); 0 on cores of its own."""
        wait = self.sync_s * (self.factor(endpoint) - 1.0)
        if work_s is None or self.sync_work_s is None or self.sync_work_s <= 0.0 or work_s >= self.sync_work_s:
            return wait
        return wait * max(0.0, work_s) / self.sync_work_s

    def _table(self, nbytes: int) -> tuple[float, float]:
        """``(half of message_cpu_s, message_wait_s)`` at ``nbytes``, interpolated (module docstring)."""
        got = self._looked_up.get(nbytes)
        if got is None:
            sizes, cpu, wait = self._points
            got = (_interpolate(sizes, cpu, nbytes) / 2, _interpolate(sizes, wait, nbytes))
            if len(self._looked_up) < 4096:         # (a run's messages have a few sizes)
                self._looked_up[nbytes] = got
        return got

    @property
    def tabled(self) -> bool:
        """Whether the message costs are a table by size (``message_cpu_s``, ``message_wait_s``)."""
        return bool(self._points[0])

    def send_s(self, nbytes: int) -> float:
        """Unstretched CPU seconds of sending one message of ``nbytes``."""
        if self._points[0]:
            return self._table(nbytes)[0]
        return self.send_message_s + nbytes * self.send_byte_s

    def recv_s(self, nbytes: int) -> float:
        """Unstretched CPU seconds of taking one message of ``nbytes``."""
        if self._points[0]:
            return self._table(nbytes)[0]
        return self.recv_message_s + nbytes * self.recv_byte_s

    def send_fixed_s(self) -> float:
        """Unstretched CPU seconds of a send that do not grow with its bytes: ``send_message_s``, or with the table
        by size half of ``message_cpu_s`` at its smallest size (the message's own cost, its system call and
        bookkeeping, before its first byte can leave); :meth:`send_s` beyond it is the part that streams the
        message's bytes."""
        return self._table(self._points[0][0])[0] if self._points[0] else self.send_message_s

    def recv_fixed_s(self) -> float:
        """Unstretched CPU seconds of taking a message that do not grow with its bytes (:meth:`send_fixed_s`'s
        counterpart: ``recv_message_s``, or half of ``message_cpu_s`` at the table's smallest size)."""
        return self._table(self._points[0][0])[0] if self._points[0] else self.recv_message_s

    def wait_fixed_s(self) -> float:
        """The part of :meth:`wait_s` that does not grow with a message's bytes (``message_wait_s`` at the table's
        smallest size; none without the table)."""
        return self._table(self._points[0][0])[1] if self._points[0] else 0.0

    def wait_s(self, nbytes: int) -> float:
        """Seconds between the delivery of a message of ``nbytes`` and the moment its receiver may take it, not
        its CPU (``message_wait_s``; none without the table); not stretched by the CPU factor."""
        if self._points[0]:
            return self._table(nbytes)[1]
        return 0.0

    @property
    def per_message(self) -> bool:
        """Whether a message costs a fixed CPU time (``send_message_s + recv_message_s > 0``, or a table by
        message size; module docstring: the SimFabric then declares a real fabric's ``message_bytes``)."""
        return self.send_message_s + self.recv_message_s > 0 or bool(self._points[0])

    def work_s(self, op: str, count: int, dtype: torch.dtype | str | None = None, *,
               transport: str | None = None) -> float:
        """Unstretched seconds of ``host_work(op, count, dtype, transport=...)`` (:data:`HOST_OPS`;
        ``transport``: the transport whose call ``"call"`` counts)."""
        if op == "call":
            if not transport:
                raise InvalidValueError("host_work('call', ...) needs the name of the transport called "
                                        "(transport=...)")
            rate = self.call_s.get(transport, 0.0)
        elif op == "call_peer":
            if not transport:
                raise InvalidValueError("host_work('call_peer', ...) needs the name of the transport called "
                                        "(transport=...)")
            rate = self.call_peer_s.get(transport, 0.0)
        elif op == "sum":
            if dtype is None:
                raise InvalidValueError("host_work('sum', ...) needs the dtype of the elements summed")
            rate = self.sum_element_s.get(dtype_name(dtype))
            if rate is None:
                raise InvalidValueError(f"HostModel has no sum rate for {dtype_name(dtype)} (sum_element_s "
                                        f"has {sorted(self.sum_element_s) or 'none'}): add it to the model "
                                        f"or the profile")
        elif op == "sync":              # (per unit of share above 1: the endpoint charges sync_wait_s)
            rate = self.sync_s
        elif op == "settle":            # (a call's end: what later work the next call's sync counts starts here)
            rate = 0.0
        elif op == "scan":
            rate = self.scan_element_s
        elif op == "scan_zero":
            rate = self.scan_zero_element_s
        elif op == "switch_packet":
            rate = self.switch_packet_s
        elif op == "switch_message":
            rate = self.switch_message_s
        elif op == "copy":
            rate = self.copy_byte_s
        elif op == "fresh":
            rate = self.fresh_byte_s if count >= self.fresh_min_bytes else 0.0
        elif op == "fresh_advised":         # (None: the zeroing of its huge pages, one write of each byte)
            rate = (0.0 if count < self.fresh_min_bytes else self.fresh_advised_byte_s
                    if self.fresh_advised_byte_s is not None else self.copy_byte_s / 2)
        elif op == "fresh_later":           # (charged as touched: "fresh_touch", the endpoint's count)
            rate = 0.0
        elif op == "fresh_touch":           # (the bytes of a held fresh buffer: the endpoint caps the count)
            rate = self.fresh_byte_s
        elif op == "span":
            rate = self.span_block_s
        elif op == "index":
            rate = self.index_block_s
        elif op == "move":
            rate = self.move_byte_s
        elif op == "check":
            rate = self.check_element_s
        elif op in CODEC_RATES:
            rate = getattr(self, CODEC_RATES[op])
            if rate is None:            # (FALLBACK_RATES: the charge before the rate existed)
                if op in FALLBACK_OPS:  # (counted as that operation before: its whole charge)
                    return self.work_s(FALLBACK_OPS[op], count)
                rate = getattr(self, FALLBACK_RATES[CODEC_RATES[op]])
            factor = self.codec_contention.get(op)
            if factor is not None:      # (none: the rate alone, as before the factor existed)
                rate = rate * factor
        elif op in ("sparse_switch_packet", "sparse_switch_value", "sparse_switch_result", "sparse_switch_message",
                    "sparse_switch_round"):
            name = f"{op}_s"
            rate = getattr(self, name)
            if rate is None:            # (FALLBACK_RATES: the charge before the rate existed)
                fallback = FALLBACK_RATES[name]
                rate = 0.0 if fallback is None else getattr(self, fallback)
        else:
            raise InvalidValueError(f"host_work: unknown operation {op!r}; the operations are "
                                    f"{', '.join(HOST_OPS)}")
        if count < 0:
            raise InvalidValueError(f"host_work({op!r}): count must be >= 0, got {count}")
        return count * rate


def _interpolate(sizes: tuple, values: tuple, nbytes: int) -> float:
    """``values`` at ``nbytes``: linear between the two ``sizes`` around it, the first value below the first size,
    the line of the last two beyond the last (at least the last value); one size: its value."""
    if nbytes <= sizes[0] or len(sizes) == 1:
        return values[0]
    i = bisect_left(sizes, nbytes)
    if i == len(sizes):
        i -= 1
    x0, x1, y0, y1 = sizes[i - 1], sizes[i], values[i - 1], values[i]
    y = y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    return y if nbytes <= x1 else max(y, y1)


def _per_transport(rates, name: str, what: str, who: str) -> dict:
    """``rates`` (transport name -> seconds) checked: a mapping of non-empty names to rates >= 0."""
    if not isinstance(rates, Mapping):
        raise InvalidTypeError(f"{who}: {name} must map transport names to {what}, got {type(rates).__name__}")
    out = {}
    for k, v in rates.items():
        if not isinstance(k, str) or not k:
            raise InvalidTypeError(f"{who}: {name} has key {k!r}; its keys are transport names (e.g. 'ring')")
        out[k] = check_real(f"{name}[{k!r}]", v, low=0.0, what=who)
    return out


def _shared_entries(table, who: str) -> Mapping[float, Mapping[str, object]]:
    """``by_share`` checked (:data:`SHARED_RATES`, module docstring): shares above 1 to mappings of those rates,
    each checked as the model's own rates are, read-only."""
    if not isinstance(table, Mapping):
        raise InvalidTypeError(f"{who}: by_share must map shares of the cores (> 1) to rates, got "
                               f"{type(table).__name__}")
    out = {}
    for share, rates in table.items():
        share = check_real("a share of by_share", share, low=1.0, low_open=True, what=who)
        if not isinstance(rates, Mapping):
            raise InvalidTypeError(f"{who}: by_share[{share:g}] must map rate names to rates, got "
                                   f"{type(rates).__name__}")
        unknown = sorted(set(rates) - set(SHARED_RATES))
        if unknown:
            raise InvalidValueError(f"{who}: by_share[{share:g}] has {unknown}; the rates a share may give are "
                                    f"{', '.join(SHARED_RATES)}")
        for pair in (MESSAGE_TABLES, NATIVE_RATES):
            if len(set(pair) & set(rates)) == 1:
                raise InvalidValueError(f"{who}: by_share[{share:g}] gives {' and '.join(pair)} both or neither")
        try:
            checked = HostModel(**rates)        # (each rate checked as the model's own)
        except (InvalidValueError, InvalidTypeError) as exc:
            raise type(exc)(f"{who}: by_share[{share:g}]: {exc}") from None
        out[share] = MappingProxyType({name: getattr(checked, name) for name in rates})
    return MappingProxyType(dict(sorted(out.items())))


def _plain(value):
    """``value`` with its read-only mappings, at any depth, as dicts (what pickle can copy)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _frozen(value):
    """``value`` hashable: its mappings, at any depth, as sorted tuples of items."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _rebuild(fields: dict) -> HostModel:
    """Unpickle a :class:`HostModel` (its mappings are read-only views, which pickle cannot copy)."""
    return HostModel(**fields)
