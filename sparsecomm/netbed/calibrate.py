"""Calibration: this machine's host costs, measured with the library's own kernels, as a host profile.

``python -m sparsecomm.netbed calibrate --out host.json`` (or ``python -m sparsecomm.netbed.calibrate``)
runs :func:`calibrate` and writes its profile (:mod:`.sim_profile`); ``sc.Network.from_profile("host.json")``
models a run on this machine's hosts. Every measurement runs with one torch thread (as a netbed host or a
launched rank is given) and reports the median of its repeats. A kernel run in this process (every rate below
but the message costs, ``span_block_s``, ``index_block_s`` and ``call_s``, which are timed over gloo between
processes) is timed in the calling thread's CPU time (``time.thread_time``: on a quiet machine its wall time,
on a loaded one without the time other processes hold the core). A measurement made between processes (the
message exchanges, the per-block, per-result, per-peer and per-call costs, the contention factors) is made in
:data:`LAUNCHES` launches (the per-peer costs :data:`PEER_LAUNCHES`), one after the other, and takes the median
over them of each launch's statistic: a launch's processes land on the cores as they happen to, and meet the page
cache, Numba's compilations and gloo's first calls as they come, so that one launch's statistic moves from one
calibration to the next far more than its own calls do. The profile's ``method`` records each launch's value
(``launches_*``), the spread a reader weighs a constant by:

- ``send_message_s``, ``recv_message_s``, ``send_byte_s``, ``recv_byte_s``: a message exchange over gloo on
  127.0.0.1 between two processes (:func:`sparsecomm.launch`, the TorchFabric's ``irecv``/``isend``: each
  posts a receive from the other, sends it a message of the size and waits for both, as a ring step or a
  handshake round does; the message just written, the receive into a region last touched many exchanges before:
  the next of :data:`TURN_VECTORS` buffers of :data:`ELEMENTS` float32 in turn, as the kernel rates below, since
  one buffer received into over and over stays in the cache and takes 1.4-1.6x less from 256 KiB on than a call's
  receive buffers, kept from the call before): the median over exchanges of the slower process's time of each size
  is fitted by least squares as ``a + b * bytes``; ``a`` and ``b`` are split evenly between the sender and the
  receiver (the model charges an exchange ``send_s + recv_s`` on each side, and cannot tell them apart). An
  exchange and not a ping-pong: in a ping-pong one side sends while the other receives, their copies overlapping,
  so that its one-way time per byte is less than what a process pays that sends and receives at once, as the
  transports' processes do. On loopback the "wire" is the hosts' copies, so the whole time is host time; a fitted
  value below zero (noise) is written as 0. It is the cost a transport pays through the fabric (its waits'
  helper threads included), several times a bare ``torch.distributed`` round's;
- ``message_cpu_s``, ``message_wait_s``: the same exchanges as a table by size, which the model uses in place of
  the line (:mod:`~sparsecomm.fabric.sim.sim_host`: a message's cost is not linear in its bytes, and its CPU is not
  its latency): per size, ``message_cpu_s`` the CPU time of an exchange (``time.process_time``, the process's
  threads together; per rank the median over exchanges, the mean of the two ranks', at most the exchange's
  time), ``message_wait_s`` the rest of the exchange's time (the slower rank's median, as above), at least 0;
- ``copy_byte_s``: ``Tensor.copy_`` of a float32 vector of :data:`ELEMENTS` into another, the next of
  :data:`TURN_VECTORS` pairs in turn (as the element rates below: beyond a 32 MiB last-level cache, as a large
  gradient's are; one pair copied over and over stays in the cache and takes half the time), per byte;
- ``fresh_byte_s``, ``fresh_min_bytes``: for each size of :data:`FRESH_SIZES`, a run of calls' work copies made
  as the transports make theirs (:func:`_work_copies`: the caller's input cloned per call, a buffer allocated
  and the input copied into it, other allocations, the buffer freed; not a tight loop of one size, whose freed
  block the allocator hands straight back where a run of calls sees its pages returned to the kernel and faulted
  afresh), each timed against the same copy into a buffer kept mapped: ``fresh_min_bytes`` is the smallest size
  from which every size swept copies at least :data:`FRESH_STEP` times slower on the mean of its calls,
  ``fresh_byte_s`` the median over those sizes of the difference per byte; no such size (no step within the
  sweep): both 0 (:func:`fresh_step`);
- ``fresh_advised_byte_s``: a second run of the same calls whose buffers are advised as huge pages before the
  copy (:func:`sparsecomm.transports.buffers.fresh_empty`, the ring's and ``native``'s work copy): the median over
  the sizes from ``fresh_min_bytes`` on of its mean copy's time beyond the mapped copy per byte (at least 0); no
  step: 0 (:func:`advised_rate`);
- ``sum_element_s``: ``Tensor.add_`` of two vectors of :data:`ELEMENTS` of each dtype of
  :data:`~.sim_host.SUM_DTYPES`, the next of :data:`TURN_VECTORS` pairs in turn, per element (the ring's and
  OmniReduce's aggregator's sum);
- ``scan_element_s``, ``scan_zero_element_s``: :func:`sparsecomm.codec.nonzero_blocks` (OmniReduce's block
  scan, 256-element blocks) of a float32 vector whose every block is non-zero at its first element (the scan
  settles it there), per element; and of a zero vector (every block read to its end), per element, less that;
  each the next of :data:`TURN_VECTORS` vectors in turn;
- ``move_byte_s``: OmniReduce's block copies as it makes them, :meth:`~sparsecomm.transports.omnireduce.blocks.
  BlockSink.write` of a message's blocks into a result and :meth:`~sparsecomm.transports.omnireduce.blocks.
  DenseSource.gather` of a tensor's blocks into a message, each of :data:`MOVE_ELEMS` float32 (a run of
  256-element blocks; the full run's buffers beyond a 32 MiB last-level cache, as a large gradient's are), per
  byte copied;
- ``check_element_s``: a transport's finiteness guard (:func:`sparsecomm.transports._guards.all_finite`) of a
  float32 vector of :data:`MOVE_ELEMS`, per element;
- ``switch_message_s``, ``switch_packet_s``: the switch program as a real fabric's switch runs it, one compiled
  call per message (:meth:`~sparsecomm.transports.switchml.dataplane.Dataplane.execute`, results written over
  the rows, a real fabric's 256-value packets, a two-worker job whose every pair of packets completes a slot):
  the median time of a message of each of :data:`SWITCH_BURSTS` packets (less the copy that refills the
  rows), fitted by least squares as ``switch_message_s + packets * switch_packet_s``;
- ``sparse_switch_message_s``, ``sparse_switch_packet_s``, ``sparse_switch_value_s``, ``sparse_switch_result_s``:
  the sparse switch's program as its service runs it on a real fabric, per message received
  (:meth:`~sparsecomm.transports.switchml.sparse.dataplane.Dataplane.packets`, the rows taken out of the burst,
  then :meth:`~sparsecomm.transports.switchml.sparse.dataplane.Dataplane.replies`, the program run on each and its
  replies built; a compiled call per packet, a result row built in Python): a two-worker job, 256-value
  packets, bursts of each of :data:`SPARSE_SWITCH_BURSTS` packets on as many slots, all value packets or all skips
  (a program each, the cases taking turns round by round), worker 0's burst then worker 1's, which completes every
  slot (a result row each), the slots' sets alternating round by round; the median time of each worker's message
  (the burst refilled untimed), fitted by least squares with rates at least 0 (:func:`fit_nonnegative`; the
  intercept, clipped at 0, is ``sparse_switch_message_s``) as ``sparse_switch_message_s + packets *
  sparse_switch_packet_s + value packets * sparse_switch_value_s + results * sparse_switch_result_s``;
- the rates of a method's encode and decode (:data:`~.sim_host.CODEC_RATES`), each with the kernel the library
  runs: ``elementwise_element_s``, ``torch.sub`` of two float32 vectors into a third (the next of
  :data:`TURN_VECTORS` triples in turn), per element;
  ``select_element_s``, :func:`sparsecomm.compressors.topk.topk_indices_numba` of a float32 vector of
  :data:`SELECT_ELEMS` (below the sampling cutoff: every element a candidate), k 1%, per element;
  ``sample_element_s``, :func:`sparsecomm.compressors.topk.sample_magnitudes` of a large vector, per sampled
  magnitude; ``collect_element_s``, the sampled top-k's candidate pass (:func:`sparsecomm.compressors.topk.collect_ge`
  at the threshold its sample gives for k of :data:`COLLECT_RATIO`) over the next of three float32 vectors of
  ``elements`` in turn (beyond a 32 MiB last-level cache, as a large gradient is), per element; ``matmul_mac_s``, ``matmul_t_mac_s`` and ``matmul_outer_mac_s``, PowerSGD's products ``M Q`` and
  ``M^T P`` (as it computes them, :func:`sparsecomm.methods.powersgd.factor_product`) and its estimate ``P Q^T``
  (:func:`sparsecomm.methods.powersgd.outer_product`) of a :data:`MATMUL_SHAPE` float32 matrix, per multiply-add,
  as the method runs them: the factors orthonormalised by its QR (:func:`sparsecomm.methods.powersgd.orthonormal`,
  whose layout picks the BLAS kernel), and each product on the next of :data:`MATMUL_BUFFERS` matrices in turn (full:
  beyond a 32 MiB last-level cache, as a gradient's matrices are when the method reads them after a backward; one
  matrix timed over and over would stay in the cache and take half the time); ``kernel_call_s``, a round of method
  ``ef`` around the
  identity on :data:`KERNEL_ELEMS` float32 (an encode and a decode, whose size does not count), per kernel call
  they declare (:meth:`~sparsecomm.methods.base.Method.work`);
- ``codec_contention``: the elementwise pass and PowerSGD's three products (:data:`CONTENDED_OPS`, as
  ``elementwise_element_s``, ``matmul_mac_s`` and the others time them, the products on :data:`MATMUL_BUFFERS`
  matrices in turn) in one process per core (:func:`sparsecomm.launch`, gloo,
  one torch thread each), rounds of each product timed by rank 0 alone (the others waiting at a barrier) and then
  by every rank at once, the two taking turns :data:`CONTENTION_ROUNDS` times: per product the median of the
  ranks' medians at once over rank 0's median alone, at least 1 (:func:`contention_costs`): how much longer a
  kernel takes while every core runs one, as the netbed's hosts run their encodes and decodes together (the
  cores share the last-level cache and the memory bus), which the rates above, timed alone, do not show; none
  on a machine of one core. Timed alone on a machine that other processes keep busy, a kernel is slowed already
  and the factor reads low: calibrate on a quiet machine;
- ``span_block_s``, ``index_block_s``: OmniReduce's per-block costs beyond its bytes, sums and scan, fitted on
  its own calls: a call of each of :data:`BLOCK_POINTS` (two sizes, a sparse and a denser input of random
  non-zero blocks, 256-element float32 blocks as the transport's default) between two processes over gloo on
  127.0.0.1, the points taking turns call by call, the median over calls of the slowest rank's time, less the
  same call modelled on the SimFabric with every rate above; the difference is fitted by least squares as
  ``c + span_block_s * S + index_block_s * I``, where ``S`` and ``I`` are how far the modelled call moves per
  second per block of each (the call modelled again with that rate at :data:`PROBE_S`: the blocks charged on its
  critical path) and ``c`` is the per-call cost (measured next, as ``call_s``); a rate fitted below zero is
  written as 0, the others fitted again without it;
- ``sparse_switch_round_s``: the sparse switch's workers' work per result they take (beyond its program's rates,
  fitted on its own calls as ``span_block_s`` is): a dense call of each of :data:`SPARSE_SWITCH_POINTS` between
  two processes and the switch's over gloo on 127.0.0.1 (``calibrate --pin-cores``: each rank on a core of its
  own turn, the workers on separate cores, modelled with the two workers alone sharing the cores, as a run on
  pinned ranks is modelled; unpinned, the kernel runs both workers on one core in some calls and not in others,
  and the fit takes the mix of the two the calls met), the points taking turns call by call, the median over
  calls of the slowest rank's time, less the same call modelled on the SimFabric with every rate above; the
  difference fitted by least squares as ``c + sparse_switch_round_s * R`` (``R``: the results charged on the
  modelled call's critical path, the call modelled again with the rate at :data:`PROBE_S`; ``c`` the per-call
  cost ``call_s`` then measures), the rate at least 0;
- ``native_message_s``, ``native_byte_s``: the cost of a message of gloo's own ring all-reduce (C++ on gloo's
  threads: no Python per message; :class:`~sparsecomm.transports.native.model.GlooRing` models its segments),
  fitted on its own calls as ``span_block_s`` is: ``dist.all_reduce`` in place of each of :data:`NATIVE_POINTS`
  float32 between two processes over gloo on 127.0.0.1, the sizes taking turns call by call, the median over calls
  of the slowest rank's time, the median over :data:`LAUNCHES` launches; less the same calls modelled on the
  SimFabric by the model of gloo's ring with every rate above and both native rates 0 (its sums at
  ``sum_element_s``); the difference fitted by least squares as ``c + native_message_s * M + native_byte_s * B``
  (``M`` and ``B``: the messages and bytes charged on the modelled call's critical path, the call modelled again
  with each rate at a probe, :data:`NATIVE_PROBES`; ``c``, ``dist.all_reduce``'s own fixed cost, not kept: the
  ``native`` transport's per call, ``call_s``, is measured with these rates in the model), the rates at least 0;
- ``call_peer_s``: per transport of :data:`PEER_CALLS`, the part of a call's cost that grows with its workers
  (:mod:`~sparsecomm.fabric.sim.sim_host`: a call of ``n`` workers costs ``call_s + (n - 1) * call_peer_s``): calls
  as ``call_s``'s below, between 2 and between :data:`PEER_WORKERS` processes over gloo on 127.0.0.1, the two
  sizes' launches taking turns (:data:`PEER_LAUNCHES` each); a call timed in its process's CPU time
  (``time.process_time``, its threads together: the work the model charges, which it stretches by the share of the
  cores itself, and which other processes' load on the machine leaves as it is where it would stretch a wall
  time), per rank the median over calls, the mean over the ranks, less the same call modelled on the SimFabric with
  every rate above and each endpoint on a core of its own (share 1): the cost ``r_n`` of a call of ``n`` beyond
  its modelled work; ``call_peer_s`` is ``(r_PEER_WORKERS - r_2) / (PEER_WORKERS - 2)``, at least 0 (``call_s``,
  measured next with it in the model, is then the rest of a 2-worker call's cost);
- ``call_s``: per transport of :data:`CALL_GROUPS`, a call of :data:`CALL_ELEMS` float32 (``native``'s of
  :data:`CALL_ELEMS_OF`'s, just above its ``all_gather`` path's limit: the cost of gloo's all-reduce; dense; for
  those of :data:`SPARSE_CALLS`, the top-k 1% payload they carry) between two
  processes over gloo on 127.0.0.1 (its services started as the netbed's are), the median over calls of the
  slowest rank's time, less the same call modelled on the SimFabric with every rate above (loopback: no
  wire of its own, the hosts' copies are the per-byte rates; the processes sharing this machine's cores
  as :meth:`~.sim_host.HostModel.sharing` says): what a call costs beyond its messages, bytes, sums, scans
  and packets (and OmniReduce's blocks, with the two rates above) -- its Python, whatever its size (at least
  0), divided by the share of the cores the model stretched that call by (:meth:`~.sim_host.HostModel.sharing`:
  1 for two workers on two cores; 1.5 for a switch's call, two workers and the switch on two cores): the model
  stretches ``call_s`` by the share too, so the call modelled with the profile is the call measured (before, a
  switch's ``call_s`` was the residual itself, charged 1.5 times over: 4 ms of a 1 Gbit/s MLP step's 8 ms
  too many per call; ``--calls-into`` fits a profile's recorded calls again).
  ``native`` is modelled as gloo's ring (:class:`~sparsecomm.transports.native.model.GlooRing`, its messages at
  the native rates below): its ``call_s`` is the rest of a ``native`` call beyond gloo's own all-reduce;
- ``sync_s`` (:func:`sync_costs`; :mod:`~sparsecomm.fabric.sim.sim_host`): the wait of a call for its last worker
  where the processes outnumber the cores, per call and per unit of share above 1: :data:`PEER_WORKERS` processes
  over gloo on 127.0.0.1 (more than this machine's cores where it has fewer; on as many cores or more, 0 and
  nothing measured), each running :data:`CALLS` times a loop of :data:`SYNC_WORK_S` of one core's CPU work (a
  128 x 128 matrix product, repeated) and a ``native`` call of :data:`CALL_ELEMS_OF`'s size, the pattern of a
  training step's compressor between its calls; per rank the loop's mean time, the mean over the ranks, the
  median over :data:`LAUNCHES` launches, less the same loop modelled on the SimFabric (its work stretched by
  the share, :meth:`~.sim_host.HostModel.sharing`, the call as gloo's ring charged ``native``'s ``call_s`` with
  every rate above), divided by the share above 1, at least 0. It needs the processes' own load and none other: run
  it on a quiet machine (``python -m sparsecomm.netbed.calibrate --sync-into P --out Q`` measures it alone, with
  the other rates of the profile ``P``, and writes ``P`` with it to ``Q``);
- ``by_share`` (:func:`shared_costs`; :mod:`~sparsecomm.fabric.sim.sim_host`, :data:`~.sim_host.SHARED_RATES`):
  where :data:`PEER_WORKERS` processes outnumber this machine's cores (4 on 2: a share of 2), the rates whose cost
  there is not the two-process cost stretched by the share, fitted again with :data:`PEER_WORKERS` processes and
  the model at that share, as an entry at that share: the message tables from the same exchanges as a ring's shift
  (each process sends to the next and receives from the one before; the slowest rank's time, the ranks' mean CPU),
  the CPU at most the exchange over the share (the model stretches it by the share) and the wait the rest; the
  native rates as above, ``dist.all_reduce`` between :data:`PEER_WORKERS` processes, modelled with that entry's
  tables; ``call_s`` of the transports that need no service (those of ``CALL_GROUPS[()]``) as above between
  :data:`PEER_WORKERS` processes, modelled with the entry's tables and native rates (the residual divided by the
  share, as above: wall time, which the model's stretch gives back), at least 0. It is measured before ``sync_s``, whose loop
  is modelled with it. Like ``sync_s`` it needs the processes' own load and none other
  (``python -m sparsecomm.netbed.calibrate --shared-into P --out Q`` measures it, and ``sync_s`` again, alone,
  with the other rates of ``P``). On as many cores as :data:`PEER_WORKERS` or more: none (every share the
  two-process rates stretched, as before it existed).

When host costs are modelled, ``Network.latency_us`` should be the wire's latency alone: the hosts'
per-message share, which ``latency_us`` otherwise stands for, is then ``send_message_s + recv_message_s``.

Where this process may build a netbed (root), the profile also records the netbed's own latency (its ``netbed``,
:mod:`~sparsecomm.fabric.sim.sim_profile`; :func:`netbed_costs`): the one-way time of a small message between
the two hosts of a netbed at ``--netbed-gbps`` (:func:`~sparsecomm.fabric.probe.fabric_latency_s`, ring shifts
of 256 bytes over the netbed's gloo) less the same probe between two processes on 127.0.0.1 (the loopback whose
exchanges the message rates above are fitted on: a small one costs ``send_message_s + recv_message_s``), the
launches taking turns, at least 0: what a netbed message costs beyond the hosts' loopback costs (the namespaces'
veth links, the top of rack's forwarding and ``htb``, the ranks' wake-ups across them), the wire latency of a
model of the netbed (``experiments/bench/netbed_vs_sim.py``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import InvalidValueError
from ..fabric.sim.sim_host import SUM_DTYPES, HostModel
from ..fabric.sim.sim_profile import host_from_profile, load_profile, profile_dict
from ..transports.buffers import fresh_empty
from ..transports.native.collectives import GATHER_SUM_BYTES

__all__ = ["busy_endpoints", "calibrate", "calls_into", "main", "shared_into", "sync_into", "write_profile"]

#: message sizes (bytes) of the gloo exchange, quick and full
MESSAGE_SIZES = {True: (64, 16384, 262144), False: (64, 4096, 65536, 262144, 1 << 20, 4 << 20)}
#: exchanges per size, quick and full
ROUNDS = {True: 20, False: 200}
#: elements of the vectors copied, summed and scanned, quick and full
ELEMENTS = {True: 1 << 18, False: 1 << 22}
#: repeats of each kernel timing, quick and full
REPEATS = {True: 5, False: 15}
#: the vectors of :data:`ELEMENTS` (pairs, triples) that the copy, sum, scan and elementwise rates take in turn, a
#: call each (full: three of 16 MiB, beyond a 32 MiB last-level cache, as a large gradient's are: one vector
#: timed over and over stays in the cache, and its rate is that of a gradient read again at once)
TURN_VECTORS = 3
#: bytes of the buffers of the fresh-buffer sweep, quick and full: from the transports' advice threshold (one huge
#: page, :data:`sparsecomm.transports.buffers.ADVISE_MIN_BYTES`) to beyond glibc's largest mmap threshold (32 MiB on
#: 64-bit; a request of 32 MiB with its header is above it)
FRESH_SIZES = {True: (4 << 20, 48 << 20), False: (2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)}
#: calls of each run of work copies, quick and full (a fresh copy above the threshold takes ~0.05 s per 64 MiB)
FRESH_REPEATS = {True: 4, False: 10}
#: calls of each run before those timed (the allocator's thresholds as a run of calls leaves them)
FRESH_WARMUP = 2
#: a size is charged as fresh where its fresh fill takes at least this many times its mapped fill (:func:`fresh_step`)
FRESH_STEP = 2.0
#: the tag of the calibration's messages
TAG = 7
#: packets per message of the switch timing (two points of the line per-message + per-packet), quick and full
SWITCH_BURSTS = {True: (2, 256), False: (2, 64, 256, 1024)}
#: packets per message of the sparse switch's timing, quick and full (its bursts hold up to 1024)
SPARSE_SWITCH_BURSTS = {True: (8, 128), False: (8, 64, 256, 1023)}
#: the transports whose per-call cost is measured, by the services one launch of them needs
CALL_GROUPS = {(): ("native", "ring", "allgather", "omnireduce"), ("switch",): ("switch",),
               ("sparse-switch",): ("sparse-switch",)}
#: the transports whose call cost per other worker is measured (``call_peer_s``): those whose per-call Python walks
#: every peer (OmniReduce's channels per aggregator and workers per aggregator, the allgather's payload per peer)
PEER_CALLS = ("omnireduce", "allgather")
#: the workers of the larger launch of the per-peer timing (the smaller has 2, as ``call_s``'s)
PEER_WORKERS = 4
#: launches of each size of the per-peer timing, taking turns, quick and full
PEER_LAUNCHES = {True: 1, False: 3}
#: single-core CPU seconds of work before each call of the sync timing (``sync_s``): a few of the scheduler's slices
#: (Linux's base slice is 0.75 ms x (1 + log2 cores), up to 8 cores)
SYNC_WORK_S = 0.004
#: float32 elements of a call of the per-call timing (64 OmniReduce blocks, 16 of the switch's packets)
CALL_ELEMS = 1 << 14
#: the transports whose per-call timing takes another size than :data:`CALL_ELEMS`: ``native``, the smallest
#: float32 call above :data:`~sparsecomm.transports.native.collectives.GATHER_SUM_BYTES`, a call of gloo's
#: all-reduce (the path of every call the model's ``native``, ``ring``'s messages, stands for), not the
#: ``all_gather`` and local sum of a call of at most that size
CALL_ELEMS_OF = {"native": GATHER_SUM_BYTES // 4 + 1}
#: float32 elements of the ``dist.all_reduce`` calls of the native message fit (``native_message_s``,
#: ``native_byte_s``), quick and full. Between two processes gloo's ring cuts a call into 4 segments up to 4 MiB
#: (16 KiB, 256 KiB, 1 MiB each here), beyond that into segments of 1 MiB, its longest (16 and 32 here): the messages
#: of a call stay 4 while its bytes grow, then grow with them, and the change of the slope at 4 MiB is what tells the
#: per-message rate from the per-byte one
NATIVE_POINTS = {True: (GATHER_SUM_BYTES // 4 + 1, 1 << 18),
                 False: (GATHER_SUM_BYTES // 4 + 1, 1 << 18, 1 << 20, 1 << 22, 1 << 23)}
#: the rates with which the native message fit's calls are modelled again to count the messages and bytes they charge
NATIVE_PROBES = {"native_message_s": 1e-6, "native_byte_s": 1e-12}
#: the transports whose per-call cost is timed on a sparse payload, the kind they carry (a top-k 1%: its values and
#: indices travel as two messages, which a dense call's one does not show)
SPARSE_CALLS = ("allgather",)
#: timed calls per transport (after two untimed), quick and full
CALLS = {True: 6, False: 30}
#: OmniReduce's calls of the per-block fit, (float32 elements, density of non-zero 256-element blocks), quick
#: and full: two sizes (the larger one, full, beyond a 32 MiB last-level cache, as a large gradient is; quick,
#: a smoke run, within it) at a sparse and a denser input
BLOCK_POINTS = {True: ((1 << 14, 0.05), (1 << 14, 0.5), (1 << 18, 0.05), (1 << 18, 0.5)),
                False: ((1 << 18, 0.02), (1 << 18, 0.3), (1 << 24, 0.02), (1 << 24, 0.3))}
#: the block of the per-block fit's inputs (OmniReduce's default)
BLOCK = 256
#: the rate (s/block) with which a point is modelled again to count the blocks it charges
PROBE_S = 1e-6
#: the sparse switch's calls of the per-result fit of its workers, (float32 elements, density of non-zero
#: 256-element blocks), quick and full: dense calls of 16 and 256 packets per worker (full: and 1024)
SPARSE_SWITCH_POINTS = {True: ((1 << 12, 1.0), (1 << 16, 1.0)), False: ((1 << 12, 1.0), (1 << 16, 1.0), (1 << 18, 1.0))}
#: timed calls per point of the sparse switch's per-result fit, quick and full
SPARSE_SWITCH_CALLS = {True: 3, False: 7}
#: the netbed's link rate (Gbit/s) at which its per-message latency is measured (``calibrate --netbed-gbps``)
NETBED_GBPS = 1.0
#: shifts of the netbed's latency probe, quick and full
NETBED_ROUNDS = {True: 30, False: 200}
#: launches of the netbed's latency probe and of the loopback's, taking turns, quick and full
NETBED_PAIRS = {True: 1, False: 2}
#: elements of the top-k timed for ``select_element_s`` (below the top-k's sampling cutoff)
SELECT_ELEMS = 1 << 16
#: the kept fraction of the top-k whose candidate pass is timed for ``collect_element_s`` (the pass reads every
#: element whatever the threshold; its candidates are a few times k)
COLLECT_RATIO = 1e-3
#: (rows, columns, rank) of PowerSGD's products timed for ``matmul_mac_s`` and ``matmul_t_mac_s``, quick and full
MATMUL_SHAPE = {True: (256, 256, 4), False: (1024, 1024, 4)}
#: matrices of :data:`MATMUL_SHAPE` the products of ``matmul_mac_s``, ``matmul_t_mac_s`` and ``matmul_outer_mac_s``
#: take in turn, quick and full (full: 12 of 4 MiB, and as many results of the estimate, beyond a 32 MiB last-level
#: cache)
MATMUL_BUFFERS = {True: 2, False: 12}
#: the operations whose slowdown with every core busy is measured (``codec_contention``): an elementwise pass and
#: PowerSGD's products
CONTENDED_OPS = ("elementwise", "matmul", "matmul_t", "matmul_outer")
#: rounds of ``codec_contention``'s timing (alone, then every core at once, taking turns), quick and full
CONTENTION_ROUNDS = {True: 2, False: 6}
#: elements of the round timed for ``kernel_call_s``
KERNEL_ELEMS = 16
#: float32 elements of the buffers of ``move_byte_s`` and ``check_element_s``, quick and full (full: 64 MiB each,
#: beyond a 32 MiB last-level cache)
MOVE_ELEMS = {True: 1 << 18, False: 1 << 24}


#: launches of each measurement made between processes (the message exchanges, OmniReduce's per-block and the sparse
#: switch's per-result fits, the per-call costs, the kernels' contention; the per-peer costs have
#: :data:`PEER_LAUNCHES`), quick and full. Each launch places its processes on the cores afresh and meets the page
#: cache, Numba's and gloo's first calls as they come, so that one launch's statistic moves from one calibration to
#: the next by more than its own calls spread: the profile takes the median over the launches of each launch's
#: statistic, and records every launch's (``method``)
LAUNCHES = {True: 1, False: 3}
#: rounds of method ``ef`` per timing of ``kernel_call_s`` (a round takes some 10 us: a timing of a few is as
#: coarse as the machine's scheduling)
KERNEL_ROUNDS = 50


def _launches(fn: Callable, n: int, count: int, **kw) -> list:
    """``count`` launches of ``fn`` on ``n`` processes (:func:`sparsecomm.launch` with ``kw``), one after the
    other: each launch's list of its ranks' results."""
    from .. import launch

    return [launch(fn, n, **kw) for _ in range(count)]


def _slowest(ranks: list, i: int | str, count: int) -> float:
    """Point ``i`` of one launch's ranks (each a list per point, or a dict per call name, of ``count`` call times):
    the median over the calls of the slowest rank's time."""
    return statistics.median(max(r[i][j] for r in ranks) for j in range(count))


def _points_over_launches(runs: list, points: int, calls: int) -> tuple[list[float], list[list[float]]]:
    """Per point, the median over the launches ``runs`` of each launch's :func:`_slowest`; and each launch's."""
    each = [[_slowest(ranks, i, calls) for i in range(points)] for ranks in runs]
    return [statistics.median(e[i] for e in each) for i in range(points)], each


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one run to warm up, in the calling thread's CPU
    time (module docstring: ``fn`` runs on this thread alone)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def _exchanges(ctx, sizes: tuple[int, ...], rounds: int, span: int) -> list[tuple[float, float]]:
    """Rank 0: per size, the median exchange (every rank posts a receive from the rank before it, sends the rank
    after it a message of that size and waits for both, a ring's shift; on two ranks each with the other), the
    slowest rank's time of each exchange, and the CPU time of an exchange (the process's, all its threads:
    ``time.process_time``), the median over exchanges of each rank's, the mean of the ranks'; the other ranks:
    ``[]``. Each exchange sends a message just written (as a sum or a gather leaves it) and receives into a region
    last touched many exchanges before: the next of :data:`TURN_VECTORS` buffers of ``span`` bytes (at least the
    size) in turn, at the buffer's next offset, so that the receives write beyond the cache, as a call's receive
    buffers, kept from the call before, are met."""
    torch.set_num_threads(1)
    f = ctx.fabric
    n = ctx.world_size
    send_to, recv_from = (ctx.rank + 1) % n, (ctx.rank - 1) % n

    def rounds_of(size: int, count: int) -> tuple[list[float], float]:
        k, whole = TURN_VECTORS, max(size, span)
        out = torch.empty(size, dtype=torch.uint8)          # (written before each round: in the cache, as a sum's)
        intos = [torch.zeros(whole, dtype=torch.uint8) for _ in range(k)]     # (zeroed: mapped before any round)
        slots = whole // size
        times, cpu = [], []
        for i in range(count):
            at = (i // k) % slots * size
            into = intos[i % k][at: at + size]
            out.fill_(i & 0xFF)
            t, c = time.perf_counter(), time.process_time()
            r = f.irecv(into, recv_from, TAG)
            f.isend(out, send_to, TAG).wait()
            r.wait()
            cpu.append(time.process_time() - c)
            times.append(time.perf_counter() - t)
        return times, statistics.median(cpu)

    rounds_of(sizes[0], max(10, rounds // 2))       # warm-up: connections, the fabric's helper threads
    runs = []
    for size in sizes:
        rounds_of(size, max(2, rounds // 20))       # (and each size's: its buffers' first copies)
        runs.append(rounds_of(size, rounds))
    mine = torch.tensor([r[0] for r in runs], dtype=torch.float64)
    cpu = torch.tensor([r[1] for r in runs], dtype=torch.float64)
    if ctx.rank:
        f.send(mine, 0, TAG + 1)
        f.send(cpu, 0, TAG + 2)
        return []
    slowest, cpus = mine.clone(), [cpu]
    for peer in range(1, n):
        theirs, their_cpu = torch.empty_like(mine), torch.empty_like(cpu)
        f.recv(theirs, peer, TAG + 1)
        f.recv(their_cpu, peer, TAG + 2)
        slowest = torch.maximum(slowest, theirs)
        cpus.append(their_cpu)
    mean_cpu = (sum(cpus) / n).tolist()
    return [(statistics.median(row), c) for row, c in zip(slowest.tolist(), mean_cpu)]


def message_costs(quick: bool = False, workers: int = 2, share: float = 1.0) -> dict:
    """The per-message and per-byte costs of a gloo loopback exchange (module docstring): the four rates, the
    tables by size (``message_cpu_s``, ``message_wait_s``) and the measurements they were fitted to: per size the
    median over :data:`LAUNCHES` launches of each launch's (``launches_exchange_s``, ``launches_exchange_cpu_s``).
    ``workers``: the processes exchanging (a ring's shift beyond 2); ``share``: the stretch the model gives their
    CPU there (:meth:`~.sim_host.HostModel.sharing`), so that a size's CPU, stretched, and wait give back its
    exchange: the CPU at most the exchange over the share, the wait the rest (at a share of 1: the CPU at most the
    exchange, the wait the rest)."""
    sizes = MESSAGE_SIZES[quick]
    fn = functools.partial(_exchanges, sizes=sizes, rounds=ROUNDS[quick], span=ELEMENTS[quick] * 4)
    runs = [r[0] for r in _launches(fn, workers, LAUNCHES[quick], backend="gloo", timeout_s=120.0)]
    measured = [(statistics.median(r[i][0] for r in runs), statistics.median(r[i][1] for r in runs))
                for i in range(len(sizes))]
    exchange = np.array([m[0] for m in measured])
    cpu = [min(m[1], m[0] / share) for m in measured]   # (CPU beyond the exchange's wall: its threads in parallel)
    slope, intercept = np.polyfit(np.array(sizes, dtype=np.float64), exchange, 1)
    a, b = max(0.0, float(intercept)), max(0.0, float(slope))
    return {"send_message_s": a / 2, "recv_message_s": a / 2, "send_byte_s": b / 2, "recv_byte_s": b / 2,
            "message_cpu_s": {n: float(c) for n, c in zip(sizes, cpu)},
            "message_wait_s": {n: float(max(0.0, w - share * c)) for n, w, c in zip(sizes, exchange, cpu)},
            "fit": {"sizes": list(sizes), "exchange_s": [float(x) for x in exchange],
                    "exchange_cpu_s": [float(m[1]) for m in measured],
                    "intercept_s": float(intercept), "slope_s_per_byte": float(slope),
                    "launches_exchange_s": [[float(m[0]) for m in r] for r in runs],
                    "launches_exchange_cpu_s": [[float(m[1]) for m in r] for r in runs]}}


def kernel_costs(quick: bool = False) -> dict:
    """``copy_byte_s``, ``sum_element_s`` (per dtype), ``scan_element_s``, the switch's rates and those of a
    method's encode and decode (module docstring), with one torch thread."""
    from ..codec import nonzero_blocks

    n, reps, k = ELEMENTS[quick], REPEATS[quick], TURN_VECTORS
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen) for _ in range(k)]
    ys = [torch.zeros(n) for _ in range(k)]
    turn = itertools.cycle(range(k))
    copy_byte_s = _median_s(lambda: _copy(xs, ys, next(turn)), reps) / (n * xs[0].element_size())
    sums = {}
    for name in SUM_DTYPES:
        dt = getattr(torch, name)
        a = [(torch.randn(n, generator=gen) * 100).to(dt) for _ in range(k)]
        b = [(torch.randn(n, generator=gen) * 100).to(dt) for _ in range(k)]
        if not dt.is_floating_point:
            for v in a:
                v.zero_()                  # int32: no wrap-around over the repeats
        sums[name] = _median_s(lambda: _add(a, b, next(turn)), reps) / n
    block = 256
    zeros = [torch.zeros(n) for _ in range(k)]
    scan_element_s = _median_s(lambda: nonzero_blocks(xs[next(turn)], block), reps) / n   # (randn: no value is 0)
    scan_zero_element_s = max(0.0, _median_s(lambda: nonzero_blocks(zeros[next(turn)], block), reps) / n
                              - scan_element_s)

    return {"copy_byte_s": copy_byte_s, "sum_element_s": sums, "scan_element_s": scan_element_s,
            "scan_zero_element_s": scan_zero_element_s,
            **block_copy_costs(quick), **switch_costs(quick), **sparse_switch_costs(quick), **codec_costs(quick)}


def _copy(xs: list[torch.Tensor], ys: list[torch.Tensor], i: int) -> torch.Tensor:
    return ys[i].copy_(xs[i])


def _add(a: list[torch.Tensor], b: list[torch.Tensor], i: int) -> torch.Tensor:
    return a[i].add_(b[i])


def _sub(xs: list[torch.Tensor], ys: list[torch.Tensor], zs: list[torch.Tensor], i: int) -> torch.Tensor:
    return torch.sub(xs[i], ys[i], out=zs[i])


def block_copy_costs(quick: bool = False) -> dict:
    """``move_byte_s`` and ``check_element_s`` (module docstring), with one torch thread."""
    from ..transports._guards import all_finite
    from ..transports.omnireduce.blocks import BlockSink, DenseSource

    n, reps = MOVE_ELEMS[quick], REPEATS[quick]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, generator=gen)
    result, message = torch.zeros(n), torch.zeros(n)
    ids = np.arange(n // BLOCK)
    data = message.view(-1, BLOCK)
    source = DenseSource(x, BLOCK)

    def moves():
        sink = BlockSink(result, BLOCK)
        if sink.write(ids, data) or source.gather(ids, data):
            raise RuntimeError("calibrate: a run of blocks was moved by its index")

    move_byte_s = _median_s(moves, reps) / (2 * n * x.element_size())
    check_element_s = _median_s(lambda: all_finite(x), reps) / n
    return {"move_byte_s": move_byte_s, "check_element_s": check_element_s}


def fresh_step(sizes, fresh_s, mapped_s, step: float = FRESH_STEP) -> tuple[float, int]:
    """``(fresh_byte_s, fresh_min_bytes)`` of a sweep (module docstring): ``sizes`` (bytes, increasing) and the
    time of a fill of each, fresh and mapped. The threshold is the smallest size from which every size's fresh
    fill takes at least ``step`` times its mapped one, the rate the median over those sizes of
    ``(fresh - mapped) / size``; none: ``(0.0, 0)``."""
    costly = [f >= step * m for f, m in zip(fresh_s, mapped_s)]
    first = len(sizes)
    while first > 0 and costly[first - 1]:
        first -= 1
    if first == len(sizes):
        return 0.0, 0
    rate = statistics.median((f - m) / b for b, f, m in zip(sizes[first:], fresh_s[first:], mapped_s[first:]))
    return float(rate), int(sizes[first])


def advised_rate(sizes, advised_s, mapped_s, threshold: int) -> float:
    """``fresh_advised_byte_s`` of a sweep (module docstring): the median over the ``sizes`` from ``threshold``
    (``fresh_min_bytes``) on of ``(advised - mapped) / size``, at least 0; no threshold (0, no step): 0."""
    if not threshold:
        return 0.0
    rates = [(a - m) / b for b, a, m in zip(sizes, advised_s, mapped_s) if b >= threshold]
    return max(0.0, float(statistics.median(rates))) if rates else 0.0


def _work_copies(n: int, calls: int, advised: bool) -> tuple[list[float], list[float]]:
    """CPU seconds (this thread's: the page faults are its own) of ``calls`` work copies of ``n`` float32 made as
    the ring and ``native`` make theirs in a run of calls, and of the same copy into a buffer kept mapped: per
    call the caller's input cloned (the one before freed once it is made), a buffer allocated (``advised``: by
    :func:`~sparsecomm.transports.buffers.fresh_empty`, as the transports do from its threshold on; else
    ``torch.empty``) and the input copied into it, then the copy into the mapped buffer, a buffer of half the size
    allocated by the first call and kept (the ring's receive buffer), the call's small allocations, and the work
    buffer freed (the result the caller drops). Whether a freed block's pages go back to the kernel depends on
    what else was allocated between (:mod:`sparsecomm.transports.buffers`): a tight loop of one size reuses them
    where calls do not."""
    src = torch.ones(n)
    mapped = torch.empty(n)
    mapped.copy_(src)
    kept, x = None, None
    work_s, mapped_s = [], []
    for _ in range(calls):
        x = src.clone()                         # (the caller's input; the one before is freed here)
        t0 = time.thread_time()
        w = fresh_empty(n, torch.float32) if advised else torch.empty(n)
        w.copy_(x)
        t1 = time.thread_time()
        mapped.copy_(x)
        t2 = time.thread_time()
        if kept is None:
            kept = torch.zeros(n // 2)          # (the ring's receive buffer, kept from call to call)
        small = [torch.empty(256) for _ in range(16)]
        del w, small
        work_s.append(t1 - t0)
        mapped_s.append(t2 - t1)
    return work_s, mapped_s


def _fresh_run(ctx, n: int, calls: int, advised: bool) -> tuple[list[float], list[float]]:
    """:func:`_work_copies` in a launched process (one thread, as the transports' workers run)."""
    torch.set_num_threads(1)
    return _work_copies(n, calls, advised)


def fresh_costs(quick: bool = False) -> dict:
    """``fresh_byte_s``, ``fresh_min_bytes`` and ``fresh_advised_byte_s`` (module docstring), with the sweep's
    times (``fresh_fit``): per size of :data:`FRESH_SIZES`, a run of :data:`FRESH_REPEATS` calls' work copies
    (:func:`_work_copies`) into plain buffers, and one into advised ones, after :data:`FRESH_WARMUP` calls each,
    each run in a process of its own (a fresh process's heap, as a transport's worker starts with; a run after
    others in one process meets the heap they left, and its freed blocks go back to the kernel at other sizes);
    the mean of each run's copies (the page faults come in some calls and not in others: the mean is what a run
    of calls pays per call), the median of the mapped copies."""
    sizes, reps = FRESH_SIZES[quick], FRESH_REPEATS[quick]
    fresh_s, advised_s, mapped_s = [], [], []
    for nbytes in sizes:
        n = nbytes // 4
        (plain, m1), = _launches(functools.partial(_fresh_run, n=n, calls=FRESH_WARMUP + reps, advised=False), 1, 1,
                                 backend="gloo", timeout_s=120.0)[0]
        (advised, m2), = _launches(functools.partial(_fresh_run, n=n, calls=FRESH_WARMUP + reps, advised=True), 1, 1,
                                   backend="gloo", timeout_s=120.0)[0]
        fresh_s.append(statistics.fmean(plain[FRESH_WARMUP:]))
        advised_s.append(statistics.fmean(advised[FRESH_WARMUP:]))
        mapped_s.append(statistics.median(m1[FRESH_WARMUP:] + m2[FRESH_WARMUP:]))
    rate, threshold = fresh_step(sizes, fresh_s, mapped_s)
    return {"fresh_byte_s": rate, "fresh_min_bytes": threshold,
            "fresh_advised_byte_s": advised_rate(sizes, advised_s, mapped_s, threshold),
            "fresh_fit": {"sizes": list(sizes), "fresh_s": fresh_s, "advised_s": advised_s, "mapped_s": mapped_s,
                          "step": FRESH_STEP, "calls": reps}}


def codec_costs(quick: bool = False) -> dict:
    """The rates of a method's encode and decode (module docstring), with one torch thread."""
    from .. import methods
    from ..compressors.topk import SAMPLE_SIZE, collect_ge, sample_magnitudes, sample_rank, topk_indices_numba
    from ..methods.powersgd import factor_product, orthonormal, outer_product

    n, reps = ELEMENTS[quick], REPEATS[quick]
    gen = torch.Generator().manual_seed(1)
    xs, ys, zs = _sub_vectors(gen, n)
    x, y, z = xs[0], ys[0], zs[0]           # (the first triple; later rates read them after this one)
    turn = itertools.cycle(range(TURN_VECTORS))
    elementwise = _median_s(lambda: _sub(xs, ys, zs, next(turn)), reps) / n
    a = torch.randn(SELECT_ELEMS, generator=gen).numpy()
    select = _median_s(lambda: topk_indices_numba(a, SELECT_ELEMS // 100), reps) / SELECT_ELEMS
    big = x.numpy()
    sample = _median_s(lambda: sample_magnitudes(big, SAMPLE_SIZE), reps) / SAMPLE_SIZE
    # (the candidate pass as the top-k runs it: the threshold its sample gives, each pass on the next vector)
    r = sample_rank(n, max(1, int(n * COLLECT_RATIO)))
    thr = float(np.partition(sample_magnitudes(big, SAMPLE_SIZE), SAMPLE_SIZE - r)[SAMPLE_SIZE - r])
    vecs, buf, turn = (big, y.numpy(), z.copy_(x).neg_().numpy()), np.empty(n, dtype=np.int64), itertools.count()
    collect = _median_s(lambda: collect_ge(vecs[next(turn) % 3], thr, buf), reps) / n
    rows, cols, rank = MATMUL_SHAPE[quick]
    k = MATMUL_BUFFERS[quick]
    ms = [torch.randn(rows, cols, generator=gen) for _ in range(k)]
    outs = [torch.zeros(rows, cols) for _ in range(k)]     # (written once: the decode's buffers are kept)
    # (the products as PowerSGD computes them, on its factors: orthonormal bases from its QR, and the estimate's
    # mean Q as the sum leaves it; each on the next matrix, as the method reads a gradient's beyond the cache)
    q = orthonormal(torch.randn(cols, rank, generator=gen))
    p = orthonormal(torch.randn(rows, rank, generator=gen))
    qmean = torch.randn(cols, rank, generator=gen)
    macs = rows * cols * rank
    turn = itertools.count()
    matmul = _median_s(lambda: factor_product(ms[next(turn) % k], q), reps) / macs
    matmul_t = _median_s(lambda: factor_product(ms[next(turn) % k], p, transpose=True), reps) / macs
    matmul_outer = _median_s(lambda: outer_product(p, qmean, outs[next(turn) % k]), reps) / macs
    ef = methods.get("ef", compressor="identity")
    st, g = ef.init(KERNEL_ELEMS), torch.randn(KERNEL_ELEMS, generator=gen)

    def round_():
        payload, _ = ef.encode(g, st)
        ef.decode(payload.values, 1, st)

    calls = ef.work("encode", st, KERNEL_ELEMS)["kernel"] + ef.work("decode", st, KERNEL_ELEMS)["kernel"]
    kernel = _median_s(lambda: [round_() for _ in range(KERNEL_ROUNDS)], reps) / (KERNEL_ROUNDS * calls)
    return {"elementwise_element_s": elementwise, "select_element_s": select, "sample_element_s": sample,
            "collect_element_s": collect, "matmul_mac_s": matmul, "matmul_t_mac_s": matmul_t, "matmul_outer_mac_s": matmul_outer,
            "kernel_call_s": kernel}


def _sub_vectors(gen: torch.Generator, n: int) -> tuple[list, list, list]:
    """:data:`TURN_VECTORS` triples of float32 vectors of ``n`` for the elementwise rate's ``torch.sub``
    (:func:`_sub`): each triple's two operands drawn from ``gen`` in turn, its result allocated."""
    xs, ys = [], []
    for _ in range(TURN_VECTORS):
        xs.append(torch.randn(n, generator=gen))
        ys.append(torch.randn(n, generator=gen))
    return xs, ys, [torch.empty(n) for _ in range(TURN_VECTORS)]


def _time_products(ctx, quick: bool) -> dict[str, list[tuple[float, float]]]:
    """One rank of :func:`contention_costs`: per operation of :data:`CONTENDED_OPS`, per round, (rank 0's median
    alone, this rank's median with every rank at once); the alone half is rank 0's only (NaN elsewhere)."""
    from ..methods.powersgd import factor_product, orthonormal, outer_product

    torch.set_num_threads(1)
    f = ctx.fabric
    rows, cols, rank = MATMUL_SHAPE[quick]
    k, reps = MATMUL_BUFFERS[quick], REPEATS[quick]
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    ms = [torch.randn(rows, cols, generator=gen) for _ in range(k)]
    outs = [torch.zeros(rows, cols) for _ in range(k)]
    q = orthonormal(torch.randn(cols, rank, generator=gen))
    p = orthonormal(torch.randn(rows, rank, generator=gen))
    qmean = torch.randn(cols, rank, generator=gen)
    xs, ys, zs = _sub_vectors(gen, ELEMENTS[quick])
    turn = itertools.count()
    ops = {"elementwise": lambda: _sub(xs, ys, zs, next(turn) % TURN_VECTORS),
           "matmul": lambda: factor_product(ms[next(turn) % k], q),
           "matmul_t": lambda: factor_product(ms[next(turn) % k], p, transpose=True),
           "matmul_outer": lambda: outer_product(p, qmean, outs[next(turn) % k])}
    out: dict[str, list[tuple[float, float]]] = {op: [] for op in CONTENDED_OPS}
    for _ in range(CONTENTION_ROUNDS[quick]):
        for op in CONTENDED_OPS:
            f.barrier()
            alone = _median_s(ops[op], reps) if ctx.rank == 0 else float("nan")
            f.barrier()
            out[op].append((alone, _median_s(ops[op], reps)))
    return out


def contention_costs(quick: bool = False) -> dict:
    """``codec_contention`` (module docstring): per operation of :data:`CONTENDED_OPS`, its kernel timed with
    every core busy over the same timed alone, at least 1, and the measurements; ``{}`` on one core. The rounds
    of :data:`LAUNCHES` launches are pooled (``alone_s``, ``together_s``: launch after launch), each launch's own
    factor recorded (``launches_factor``)."""
    cores = os.cpu_count() or 1
    if cores < 2:
        return {"codec_contention": {}, "contention_fit": {"cores": cores}}
    runs = _launches(functools.partial(_time_products, quick=quick), cores, LAUNCHES[quick], backend="gloo",
                     timeout_s=300.0)
    factors, fit = {}, {"cores": cores, "launches": len(runs)}
    for op in CONTENDED_OPS:
        alone, together, each = [], [], []
        for ranks in runs:
            a = [v for v, _ in ranks[0][op]]
            t = [statistics.median(r[op][i][1] for r in ranks) for i in range(len(a))]
            alone += a
            together += t
            each.append(statistics.median(t) / statistics.median(a))
        factors[op] = max(1.0, statistics.median(together) / statistics.median(alone))
        fit[op] = {"alone_s": alone, "together_s": together, "launches_factor": each}
    return {"codec_contention": factors, "contention_fit": fit}


def switch_costs(quick: bool = False) -> dict:
    """``switch_message_s`` and ``switch_packet_s`` (module docstring), with the measurements fitted."""
    from ..transports.switchml.dataplane import DEFAULT_SLOTS, HEADER, PACKET_ELEMS, T_DATA, Dataplane, SwitchConfig

    bursts, reps = SWITCH_BURSTS[quick], REPEATS[quick]
    elems = PACKET_ELEMS[-1]
    width = HEADER + elems
    dp = Dataplane(SwitchConfig(elems=elems, slots=DEFAULT_SLOTS, burst=max(bursts)))
    dp.world = 2
    times = []
    for k in bursts:
        # message m: k packets, workers 0 and 1 in turn, pair j on slot 1 + j of set m % 2 (each slot completes
        # once per message, the sets alternating as a job's do)
        tmpl = np.zeros((2, k, width), dtype=np.int32)
        i = np.arange(k)
        for v in range(2):
            tmpl[v, :, :HEADER] = np.stack([np.full(k, T_DATA), 1 + i // 2, np.full(k, v), i % 2, i // 2,
                                            np.ones(k), np.full(k, 2), np.zeros(k)], axis=1)
        tmpl[:, :, HEADER:] = 1
        rows = np.empty((k, width), dtype=np.int32)
        uc = np.empty_like(rows)
        scratch = np.empty(k, dtype=np.uint8)
        count = [0]

        def message():
            np.copyto(rows, tmpl[count[0] % 2])
            count[0] += 1
            nmc, _, bad = dp.execute(rows, rows, uc, scratch, clear=True)
            if nmc != k // 2 or bad:
                raise RuntimeError(f"calibrate: the switch program completed {nmc} of {k // 2} slots ({bad} "
                                   f"malformed) of a message of {k} packets")

        def refill():
            np.copyto(rows, tmpl[count[0] % 2])

        loops = max(1, 2048 // k)          # a message of a few packets is timed over several

        def many(fn=message):
            for _ in range(loops):
                fn()

        count[0] = 0
        many()                             # the program compiled, the slots' sets in step
        if count[0] % 2:
            message()
        t = _median_s(many, reps) - _median_s(lambda: many(refill), reps)
        times.append(max(0.0, t) / loops)
    slope, intercept = np.polyfit(np.array(bursts, dtype=np.float64), np.array(times), 1)
    return {"switch_message_s": max(0.0, float(intercept)), "switch_packet_s": max(0.0, float(slope)),
            "switch_fit": {"elems": elems, "packets": list(bursts), "message_s": [float(t) for t in times]}}


def sparse_switch_costs(quick: bool = False) -> dict:
    """``sparse_switch_message_s``, ``sparse_switch_packet_s``, ``sparse_switch_value_s`` and
    ``sparse_switch_result_s`` (module docstring), with the measurements fitted (``sparse_switch_fit``)."""
    from ..transports.switchml.dataplane import DEFAULT_SLOTS
    from ..transports.switchml.sparse.dataplane import (HEADER, MAX_BURST, T_DATA, T_SKIP, Dataplane, Header,
                                                        SparseSwitchConfig)

    bursts, reps = SPARSE_SWITCH_BURSTS[quick], REPEATS[quick]
    elems, world = 256, 2
    width = HEADER + elems
    cases = [(k, kind) for k in bursts for kind in (T_DATA, T_SKIP)]
    planes, tmpls = [], []
    for k, kind in cases:       # (a program each: its slots' sets alternate round by round)
        dp = Dataplane(SparseSwitchConfig(elems=elems, slots=DEFAULT_SLOTS, burst=MAX_BURST))
        dp.world = world
        planes.append(dp)
        # round r: worker 0's burst then worker 1's on slots 1..k, set and position r % 2
        tmpl = np.zeros((world, 2, MAX_BURST, width), dtype=np.int32)
        for w in range(world):
            for v in range(2):
                for i in range(k):
                    Header(kind, v, w, world, 1, 1 + i, v, v + 1).write(tmpl[w, v, i, :HEADER])
                tmpl[w, v, :k, HEADER:] = (1 + w) if kind == T_DATA else 0
        tmpls.append(tmpl)
    arr = np.empty((MAX_BURST, width), dtype=np.int32)
    took: list[list[list[float]]] = [[[] for _ in range(world)] for _ in cases]
    for r in range(reps + 1):            # (the cases take turns round by round; the first round untimed)
        for c, ((k, kind), dp, tmpl) in enumerate(zip(cases, planes, tmpls)):
            for w in range(world):
                np.copyto(arr, tmpl[w, r % 2])
                before = dp.stats["packets"]
                t = time.thread_time()
                _, results = dp.answer(arr, w, MAX_BURST, False)     # (the service's path: Dataplane._port)
                t = time.thread_time() - t
                took_rows = dp.stats["packets"] - before
                if took_rows != k or results != (k if w == world - 1 else 0):
                    raise RuntimeError(f"calibrate: the sparse switch's program took {took_rows} of {k} packets and "
                                       f"produced {results} results from worker {w}'s burst")
                if r:
                    took[c][w].append(t)
    points, times = [], []
    for c, (k, kind) in enumerate(cases):
        for w in range(world):
            points.append((k, k if kind == T_DATA else 0, k if w == world - 1 else 0))
            times.append(statistics.median(took[c][w]))
    x = np.array(points, dtype=np.float64)
    message, packet, value, result = fit_nonnegative(x, np.array(times))
    return {"sparse_switch_message_s": max(0.0, float(message)), "sparse_switch_packet_s": float(packet),
            "sparse_switch_value_s": float(value), "sparse_switch_result_s": float(result),
            "sparse_switch_fit": {"elems": elems, "packets": x[:, 0].astype(int).tolist(),
                                  "values": x[:, 1].astype(int).tolist(), "results": x[:, 2].astype(int).tolist(),
                                  "message_s": times, "intercept_s": float(message)}}


def call_input(name: str, numel: int, rank: int):
    """What a call of transport ``name`` is timed on: the payload it carries, :data:`SPARSE_CALLS`' a top-k 1%
    payload of ``numel`` float32 (this rank's own values), the others ``numel`` float32 ones."""
    if name in SPARSE_CALLS:
        from ..compressors import get

        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        return get("topk", ratio=0.01).compress(x)
    return torch.ones(numel)


def _clocked_calls(ctx, names: tuple[str, ...], numel: int, calls: int, numel_of: dict | None = None,
                   clock: str = "wall") -> dict[str, list[float]]:
    """Every rank: per transport of ``names``, the time of each of ``calls`` calls on :func:`call_input` of
    ``numel`` (``numel_of[name]`` where given; after two untimed), each after a barrier (``native`` is gloo's ring,
    :class:`~sparsecomm.transports.native.model.GlooRing`, on a modelled fabric). ``clock``: ``"wall"``, the
    fabric's clock (:func:`_timed_call`); ``"cpu"``, this process's CPU time (``time.process_time``, its threads
    together); on a modelled fabric either is its clock."""
    import sparsecomm.transports as transports
    from ..transports.native.model import GlooRing

    if clock not in ("wall", "cpu"):
        raise InvalidValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    torch.set_num_threads(1)
    f = ctx.fabric
    now = time.process_time if clock == "cpu" and not f.modelled_time else f.now
    out = {}
    for name in names:
        t = GlooRing(f) if name == "native" and f.modelled_time else transports.get(name, f)
        x0 = call_input(name, (numel_of or {}).get(name, numel), ctx.rank)
        for _ in range(2):          # (untimed)
            _timed_call(f, t, x0)
        out[name] = [_timed_call(f, t, x0, now) for _ in range(calls)]
    return out


def _work(reps: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """The sync timing's CPU work: ``reps`` products of two 128 x 128 matrices."""
    for _ in range(reps):
        torch.mm(a, b)


def work_reps(work_s: float) -> tuple[int, float]:
    """The repeats of :func:`_work` that take ``work_s`` of this thread's CPU time (:func:`_median_s`
    of :data:`REPEATS` timings of 50), and the CPU seconds they take."""
    torch.set_num_threads(1)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    per = _median_s(lambda: _work(50, a, b), REPEATS[False]) / 50
    reps = max(1, round(work_s / per))
    return reps, reps * per


def _sync_loop(ctx, numel: int, calls: int, reps: int, work_s: float) -> float:
    """Every rank: the mean time of ``calls`` loops of :func:`_work` (``reps``) and a ``native`` call of ``numel``
    float32 (gloo's ring, :class:`~sparsecomm.transports.native.model.GlooRing`, on a modelled fabric, where the
    work is ``work_s`` stretched by the endpoint's share of the cores, its CPU factor), after two untimed loops and
    a barrier."""
    import sparsecomm.transports as transports
    from ..transports.native.model import GlooRing

    torch.set_num_threads(1)
    f = ctx.fabric
    t = GlooRing(f) if f.modelled_time else transports.get("native", f)
    x0 = call_input("native", numel, ctx.rank)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    if f.modelled_time:
        share = f.network.host.factor(ctx.rank)

        def work() -> None:
            f.compute(work_s * share)
    else:
        def work() -> None:
            _work(reps, a, b)
    for _ in range(2):              # (untimed)
        work()
        t.allreduce(x0.clone())
    f.barrier()
    t0 = f.now()
    for _ in range(calls):
        work()
        t.allreduce(x0.clone())
    return (f.now() - t0) / calls


def _timed_call(f, t, x0, clock: Callable[[], float] | None = None) -> float:
    """The time of one ``t.allreduce`` of a copy of ``x0`` (a tensor; a payload as it is) after a barrier, on
    ``clock`` (default ``f``'s clock)."""
    clock = f.now if clock is None else clock
    x = x0.clone() if isinstance(x0, torch.Tensor) else x0
    f.barrier()
    t0 = clock()
    t.allreduce(x)
    return clock() - t0


def block_sparse(numel: int, density: float, seed: int, block: int = BLOCK) -> torch.Tensor:
    """A float32 vector of ``numel`` (a multiple of ``block``) whose non-zero ``block``-element blocks are a
    random ``density`` of them (at least one), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    nb = numel // block
    zero = torch.ones(nb, dtype=torch.bool)
    zero[torch.randperm(nb, generator=g)[: max(1, round(density * nb))]] = False
    x.view(nb, block)[zero] = 0
    return x


def _time_points(ctx, points: tuple, calls: int) -> list[list[float]]:
    """Every rank: per ``(numel, density)`` of ``points``, the time of each of ``calls`` OmniReduce calls (after
    two untimed), each after a barrier; each rank's input its own random blocks (:func:`block_sparse`). The
    points take turns, call by call (a change of the machine's load falls on every point alike), each with a
    transport of its own (its result cache in the state repeated calls of it leave)."""
    import sparsecomm.transports as transports

    torch.set_num_threads(1)
    f = ctx.fabric
    ts = [transports.get("omnireduce", f, block_size=BLOCK) for _ in points]
    xs = [block_sparse(numel, density, seed=1000 * ctx.rank + k) for k, (numel, density) in enumerate(points)]
    out: list[list[float]] = [[] for _ in points]
    for i in range(calls + 2):
        for t, x0, times in zip(ts, xs, out):
            took = _timed_call(f, t, x0)
            if i >= 2:
                times.append(took)
    return out


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``y ~ c + x @ rates`` with every rate >= 0 (the intercept ``c`` free): the best fit over
    the subsets of rates left free, the others 0 (few rates: every subset is tried). Returns ``[c, *rates]``."""
    k = x.shape[1]
    best, best_err = None, np.inf
    for mask in range(1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        a = np.column_stack([np.ones(len(y))] + [x[:, j] for j in free])
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        if (coef[1:] < 0).any():
            continue
        err = float(((a @ coef - y) ** 2).sum())
        if err < best_err - 1e-30 or best is None:
            full = np.zeros(k + 1)
            full[0] = coef[0]
            full[[1 + j for j in free]] = coef[1:]
            best, best_err = full, err
    return best


def block_costs(host: HostModel, quick: bool = False, points: tuple | None = None) -> dict:
    """``span_block_s`` and ``index_block_s`` (module docstring), with the measurements fitted (``block_fit``:
    the points, the measured and modelled times, the blocks each rate charges per point and the intercept; a
    point's measured time the median over :data:`LAUNCHES` launches of each launch's, ``launches_s``).
    ``points``: ``(numel, density)`` pairs (a multiple of :data:`BLOCK` each; default :data:`BLOCK_POINTS`)."""
    import dataclasses

    from .. import launch
    from ..fabric.sim.sim_network import Network

    points = BLOCK_POINTS[quick] if points is None else tuple(points)
    calls, cores = CALLS[quick], os.cpu_count() or 1
    runs = _launches(functools.partial(_time_points, points=points, calls=calls), 2, LAUNCHES[quick],
                     backend="gloo", timeout_s=300.0)
    measured, each = _points_over_launches(runs, len(points), calls)
    modelled = {}
    for rate in ("", "span_block_s", "index_block_s"):   # (modelled calls repeat exactly: one is timed)
        h = dataclasses.replace(host, **({rate: PROBE_S} if rate else {})).sharing(2, cores)
        sim = launch(functools.partial(_time_points, points=points, calls=1), 2,
                     network=Network(bandwidth_gbps=1e4, latency_us=0.0, host=h))
        modelled[rate] = [_slowest(sim, i, 1) for i in range(len(points))]
    base = np.array(modelled[""])
    counts = np.column_stack([(np.array(modelled[r]) - base) / PROBE_S for r in ("span_block_s", "index_block_s")])
    c, span, index = fit_nonnegative(counts, np.array(measured) - base)
    return {"span_block_s": float(span), "index_block_s": float(index),
            "block_fit": {"points": [list(p) for p in points], "block": BLOCK, "measured_s": measured,
                          "modelled_s": [float(v) for v in base], "span_blocks": counts[:, 0].tolist(),
                          "index_blocks": counts[:, 1].tolist(), "intercept_s": float(c),
                          "launches_s": each}}


def _time_sparse_switch(ctx, points: tuple, calls: int) -> list[list[float]]:
    """Every rank: per ``(numel, density)`` of ``points``, the time of each of ``calls`` sparse switch calls
    (after two untimed), each after a barrier, the points taking turns call by call (:func:`_time_points`)."""
    import sparsecomm.transports as transports

    torch.set_num_threads(1)
    f = ctx.fabric
    t = transports.get("sparse-switch", f)
    xs = [block_sparse(numel, density, seed=1000 * ctx.rank + k) for k, (numel, density) in enumerate(points)]
    out: list[list[float]] = [[] for _ in points]
    for i in range(calls + 2):
        for x0, times in zip(xs, out):
            took = _timed_call(f, t, x0)
            if i >= 2:
                times.append(took)
    return out


def busy_endpoints(transport: str, workers: int, services: int, pinned: bool = False) -> int:
    """The processes of a call of ``transport`` that share the cores, as a model of processes sharing cores counts
    them (:meth:`~sparsecomm.fabric.sim.sim_host.HostModel.sharing`): the ``workers`` and its ``services`` (each a
    process, a switch too). ``pinned`` (every rank on a core of its own turn, ``sc.launch(pin_cores=True)``): the
    workers alone where the services compute only while the workers wait for them
    (:attr:`~sparsecomm.transports.base.Transport.services_share_cores`: the sparse switch's lock-step waves).
    Unpinned, the kernel runs such workers on one core in some calls and not in others, which no fixed share
    describes; the count of every process is the slower of the two, which the loopback measures most often."""
    from .. import transports

    shares = not pinned or transports.registry.factory(transport).services_share_cores
    return workers + (services if shares else 0)


def sparse_switch_round_costs(host: HostModel, quick: bool = False, pin_cores: bool = False) -> dict:
    """``sparse_switch_round_s`` (module docstring), with the measurements fitted (``sparse_switch_round_fit``:
    the points, the measured and modelled times, the results each point's critical path charges, the
    intercept; a point's measured time the median over :data:`LAUNCHES` launches of each launch's, ``launches_s``).
    ``pin_cores``: the calls on pinned ranks, modelled with the two workers alone sharing the cores."""
    import dataclasses

    from .. import launch
    from ..fabric.sim.sim_network import Network

    points, calls = SPARSE_SWITCH_POINTS[quick], SPARSE_SWITCH_CALLS[quick]
    cores = os.cpu_count() or 1
    fn = functools.partial(_time_sparse_switch, points=points)
    runs = _launches(functools.partial(fn, calls=calls), 2, LAUNCHES[quick], backend="gloo",
                     services=["sparse-switch"], timeout_s=300.0, **({"pin_cores": True} if pin_cores else {}))
    measured, each = _points_over_launches(runs, len(points), calls)
    modelled = {}
    for rate in (0.0, PROBE_S):     # (modelled calls repeat exactly: one is timed)
        h = dataclasses.replace(host, sparse_switch_round_s=rate).sharing(
            busy_endpoints("sparse-switch", 2, 1, pin_cores), cores)
        sim = launch(functools.partial(fn, calls=1), 2, services=["sparse-switch"],
                     network=Network(bandwidth_gbps=1e4, latency_us=0.0, host=h))
        modelled[rate] = np.array([_slowest(sim, i, 1) for i in range(len(points))])
    counts = (modelled[PROBE_S] - modelled[0.0]) / PROBE_S
    c, rate = fit_nonnegative(counts[:, None], np.array(measured) - modelled[0.0])
    return {"sparse_switch_round_s": float(rate),
            "sparse_switch_round_fit": {"points": [list(p) for p in points], "measured_s": measured,
                                        "modelled_s": modelled[0.0].tolist(), "results": counts.tolist(),
                                        "intercept_s": float(c), "launches_s": each}}


def _native_points(ctx, points: tuple, calls: int) -> list[list[float]]:
    """Every rank: per float32 size of ``points``, the time of each of ``calls`` calls of ``dist.all_reduce`` in
    place (after two untimed; the model of gloo's ring, in place and unchecked, on a modelled fabric), each after a
    barrier on an input of ones, the sizes taking turns call by call (:func:`_time_points`)."""
    from ..transports.native.model import GlooRing

    torch.set_num_threads(1)
    f = ctx.fabric
    if f.modelled_time:
        reduce = GlooRing(f, inplace=True, nonfinite="pass").allreduce
    else:
        import torch.distributed as dist

        group = f.native_group

        def reduce(x: torch.Tensor) -> None:
            dist.all_reduce(x, group=group)
    xs = [torch.ones(numel) for numel in points]
    out: list[list[float]] = [[] for _ in points]
    for i in range(calls + 2):
        for x, times in zip(xs, out):
            x.fill_(1.0)
            f.barrier()
            t0 = f.now()
            reduce(x)
            took = f.now() - t0
            if i >= 2:
                times.append(took)
    return out


def native_costs(host: HostModel, quick: bool = False, points: tuple | None = None, workers: int = 2) -> dict:
    """``native_message_s`` and ``native_byte_s`` (module docstring), with the measurements fitted (``native_fit``:
    the sizes, the measured and modelled times, the messages and bytes each rate charges per size and the
    intercept; a size's measured time the median over :data:`LAUNCHES` launches of each launch's, ``launches_s``).
    ``points``: float32 sizes (default :data:`NATIVE_POINTS`); ``workers``: the processes (modelled on this
    machine's cores, :meth:`~.sim_host.HostModel.sharing`)."""
    import dataclasses

    from .. import launch
    from ..fabric.sim.sim_network import Network

    points = NATIVE_POINTS[quick] if points is None else tuple(points)
    calls, cores = CALLS[quick], os.cpu_count() or 1
    runs = _launches(functools.partial(_native_points, points=points, calls=calls), workers, LAUNCHES[quick],
                     backend="gloo", timeout_s=300.0)
    measured, each = _points_over_launches(runs, len(points), calls)
    # (the all-reduce alone: no per-call cost of the transport, no wait for a last worker)
    bare = dataclasses.replace(host, call_s={k: v for k, v in host.call_s.items() if k != "native"},
                               call_peer_s={k: v for k, v in host.call_peer_s.items() if k != "native"}, sync_s=0.0)
    modelled = {}
    for rate in ("", *NATIVE_PROBES):      # (modelled calls repeat exactly: one is timed)
        rates = {r: (NATIVE_PROBES[r] if r == rate else 0.0) for r in NATIVE_PROBES}
        h = dataclasses.replace(bare, **rates).sharing(workers, cores)
        sim = launch(functools.partial(_native_points, points=points, calls=1), workers,
                     network=Network(bandwidth_gbps=1e4, latency_us=0.0, host=h))
        modelled[rate] = [_slowest(sim, i, 1) for i in range(len(points))]
    base = np.array(modelled[""])
    counts = np.column_stack([(np.array(modelled[r]) - base) / p for r, p in NATIVE_PROBES.items()])
    c, message, byte = fit_nonnegative(counts, np.array(measured) - base)
    return {"native_message_s": float(message), "native_byte_s": float(byte),
            "native_fit": {"points": list(points), "measured_s": measured, "modelled_s": [float(v) for v in base],
                           "messages": counts[:, 0].tolist(), "bytes": counts[:, 1].tolist(),
                           "intercept_s": float(c), "launches_s": each}}


def _netbed_latency(ctx, rounds: int) -> float:
    from ..fabric.probe import fabric_latency_s

    torch.set_num_threads(1)
    return fabric_latency_s(ctx.fabric, rounds=rounds)


def netbed_costs(gbps: float = NETBED_GBPS, quick: bool = False) -> dict:
    """The netbed's per-message latency (module docstring): ``latency_s``, the one-way time of a small message
    between the two hosts of a netbed of ``gbps`` (:func:`~sparsecomm.fabric.probe.fabric_latency_s`) less the
    same probe between two processes on 127.0.0.1 (what the host rates fitted on loopback charge a message), each
    the median of :data:`NETBED_PAIRS` launches taking turns (a change of the machine's load falls on both), at
    least 0; with ``gbps``, the probes' times and the load."""
    from .. import launch
    from ..fabric.sim.sim_network import Network

    fn = functools.partial(_netbed_latency, rounds=NETBED_ROUNDS[quick])
    netbed, loopback = [], []
    for _ in range(NETBED_PAIRS[quick]):
        netbed.append(launch(fn, 2, backend="netbed", network=Network(bandwidth_gbps=gbps), timeout_s=120.0)[0])
        loopback.append(launch(fn, 2, backend="gloo", timeout_s=120.0)[0])
    measured, local = statistics.median(netbed), statistics.median(loopback)
    return {"latency_s": max(0.0, measured - local), "gbps": float(gbps), "hosts": 2,
            "netbed_s": netbed, "loopback_s": loopback,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def peer_call_costs(host: HostModel, quick: bool = False) -> dict:
    """``call_peer_s`` (module docstring): per transport of :data:`PEER_CALLS`, a call's cost per other worker,
    with the measurements (``call_peer_fit``: per transport and size of world, the measured call's CPU time, the
    median over its launches, and the modelled call)."""
    import dataclasses

    from .. import launch
    from ..fabric.sim.sim_network import Network

    calls = CALLS[quick]
    fn = functools.partial(_clocked_calls, names=PEER_CALLS, numel=CALL_ELEMS, calls=calls, clock="cpu")
    bare = dataclasses.replace(host, call_s={k: v for k, v in host.call_s.items() if k not in PEER_CALLS},
                               call_peer_s={}, cpu_share=1.0, cpu_share_by_endpoint={})
    sizes = (2, PEER_WORKERS)
    measured: dict = {(n, name): [] for n in sizes for name in PEER_CALLS}
    for _ in range(PEER_LAUNCHES[quick]):
        for n in sizes:
            real = launch(fn, n, backend="gloo", timeout_s=300.0)
            for name in PEER_CALLS:
                measured[n, name].append(statistics.mean(statistics.median(r[name]) for r in real))
    fit: dict = {name: {} for name in PEER_CALLS}
    residual = {}
    for n in sizes:
        sim = launch(functools.partial(fn, calls=1), n,
                     network=Network(bandwidth_gbps=1e4, latency_us=0.0, host=bare))
        for name in PEER_CALLS:
            real_s, model_s = statistics.median(measured[n, name]), statistics.mean(r[name][0] for r in sim)
            residual[n, name] = real_s - model_s
            fit[name][str(n)] = {"measured_cpu_s": real_s, "modelled_s": model_s,
                                 "launches_cpu_s": list(measured[n, name])}
    out = {}
    for name in PEER_CALLS:
        out[name] = max(0.0, (residual[PEER_WORKERS, name] - residual[2, name]) / (PEER_WORKERS - 2))
    return {"call_peer_s": out, "call_peer_fit": fit}


def sync_costs(host: HostModel, quick: bool = False) -> dict:
    """``sync_s`` (module docstring), with the measurement (``sync_fit``: the workers, the cores and the share, the
    work, the measured loop per launch and their median, the modelled loop)."""
    import dataclasses

    from .. import launch
    from ..fabric.sim.sim_network import Network

    cores, n = os.cpu_count() or 1, PEER_WORKERS
    shared = host.sharing(n, cores)
    fit: dict = {"workers": n, "cores": cores, "share": shared.cpu_share}
    if shared.cpu_share <= 1.0:
        return {"sync_s": 0.0, "sync_fit": fit}
    reps, work_s = work_reps(SYNC_WORK_S)
    numel = CALL_ELEMS_OF.get("native", CALL_ELEMS)
    fn = functools.partial(_sync_loop, numel=numel, calls=CALLS[quick], reps=reps, work_s=work_s)
    per_launch = [statistics.mean(launch(fn, n, backend="gloo", timeout_s=300.0))
                  for _ in range(LAUNCHES[quick])]
    model = dataclasses.replace(shared, sync_s=0.0)
    modelled = statistics.mean(launch(fn, n, network=Network(bandwidth_gbps=1e4, latency_us=0.0, host=model)))
    measured = statistics.median(per_launch)
    fit.update(work_s=work_s, work_reps=reps, numel=numel, calls=CALLS[quick], measured_s=measured,
               launches_s=per_launch, modelled_s=modelled,
               load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)
    return {"sync_s": max(0.0, measured - modelled) / (shared.cpu_share - 1.0), "sync_work_s": work_s, "sync_fit": fit}


def sync_into(path: str | Path, quick: bool = False) -> dict:
    """The profile at ``path`` with ``sync_s`` measured on this machine (:func:`sync_costs`, with the profile's other
    rates) in place of its own, the measurement as its ``method``'s ``sync_fit`` (``--sync-into``)."""
    profile = load_profile(path)
    host = host_from_profile(profile, f"host profile {str(path)!r}")
    threads = torch.get_num_threads()
    try:
        sync = sync_costs(host, quick)
    finally:
        torch.set_num_threads(threads)
    method = {**profile.get("method", {}), "sync_fit": sync.pop("sync_fit")}
    import dataclasses

    out = profile_dict(dataclasses.replace(host, **sync), date=profile.get("date", ""),
                       machine=profile.get("machine", {}), method=method)
    if "netbed" in profile:
        out["netbed"] = profile["netbed"]
    return out


def call_costs(host: HostModel, quick: bool = False, pin_cores: bool = False, workers: int = 2,
               groups: dict | None = None) -> dict:
    """``call_s`` (module docstring): per transport, the measured loopback call less the modelled one, with
    the measurements (the measured call the median over :data:`LAUNCHES` launches of each launch's median,
    ``launches_s``; ``share``, the stretch the residual is divided by). ``pin_cores``: the calls on pinned ranks,
    modelled with the processes that compute at the same moments sharing the cores (a service that computes only
    while the workers wait does not); ``workers``: the workers of a call; ``groups``: the transports by the
    services their launch needs (default :data:`CALL_GROUPS`)."""
    calls = CALLS[quick]
    measured = {}
    for services, names in (CALL_GROUPS if groups is None else groups).items():
        fn = functools.partial(_clocked_calls, names=names, numel=CALL_ELEMS, calls=calls, numel_of=CALL_ELEMS_OF)
        runs = _launches(fn, workers, LAUNCHES[quick], backend="gloo", services=list(services), timeout_s=120.0,
                         **({"pin_cores": True} if pin_cores else {}))
        for name in names:
            each = [_slowest(real, name, calls) for real in runs]
            measured[name] = {"measured_s": statistics.median(each), "launches_s": each}
    return call_residuals(host, measured, calls, pin_cores, workers, groups)


def call_residuals(host: HostModel, measured: dict, calls: int, pin_cores: bool = False, workers: int = 2,
                   groups: dict | None = None) -> dict:
    """``call_s`` of the transports of ``measured`` (name -> ``{"measured_s": the slowest rank's median call,
    ...}``, :func:`call_costs`) against the same calls modelled on the SimFabric with ``host`` (``calls`` timed
    calls each, as measured): the residual divided by the share of the cores the model stretched the call by
    (module docstring), at least 0; with the fit (the measurement's own entries, ``modelled_s`` and ``share``)."""
    from .. import launch
    from ..fabric.sim.sim_network import Network

    cores = os.cpu_count() or 1
    out, fit = {}, {}
    for services, names in (CALL_GROUPS if groups is None else groups).items():
        names = tuple(name for name in names if name in measured)
        if not names:
            continue
        fn = functools.partial(_clocked_calls, names=names, numel=CALL_ELEMS, calls=calls, numel_of=CALL_ELEMS_OF)
        busy = max(busy_endpoints(name, workers, len(services), pin_cores) for name in names)
        net = Network(bandwidth_gbps=1e4, latency_us=0.0, host=host.sharing(busy, cores))
        sim = launch(fn, workers, network=net)
        share = net.host.cpu_share
        for name in names:
            modelled = _slowest(sim, name, calls)
            out[name] = max(0.0, measured[name]["measured_s"] - modelled) / share
            fit[name] = {**measured[name], "modelled_s": modelled, "share": share}
    return {"call_s": out, "call_fit": fit}


def calls_into(path: str | Path) -> dict:
    """The profile at ``path`` with ``call_s`` fitted again to the calls its ``method.call_fit`` recorded
    (:func:`call_residuals`; nothing measured), modelled with this code's model and the profile's rates as
    :func:`calibrate` models them (no per-call costs, no wait for a last worker, no rates by share, no
    contention), the calls on pinned ranks where the profile's were (``method.pin_cores``); its rates by share
    and ``sync_s`` are kept, with ``sync_work_s`` where it lacks one and its ``method.sync_fit`` recorded the work
    per call (``--calls-into``: a profile made before a change to the model of a call, or to the fit, brought up
    to it without a quiet machine)."""
    import dataclasses

    profile = load_profile(path)
    host = host_from_profile(profile, f"host profile {str(path)!r}")
    method = profile.get("method", {})
    recorded = method.get("call_fit")
    if not recorded or "calls" not in method:
        raise InvalidValueError(f"--calls-into: the host profile {str(path)!r} records no calls (method.call_fit "
                                f"and method.calls); calibrate it again (python -m sparsecomm.netbed calibrate)")
    bare = dataclasses.replace(host, call_s={}, sync_s=0.0, by_share={}, codec_contention={})
    threads = torch.get_num_threads()
    try:
        calls = call_residuals(bare, recorded, int(method["calls"]), bool(method.get("pin_cores", False)))
    finally:
        torch.set_num_threads(threads)
    host = dataclasses.replace(host, call_s={**host.call_s, **calls["call_s"]})
    if host.sync_s and host.sync_work_s is None:
        host = dataclasses.replace(host, sync_work_s=_recorded_sync_work_s(method, path))
    out = profile_dict(host, date=profile.get("date", ""), machine=profile.get("machine", {}),
                       method={**method, "call_fit": {**recorded, **calls["call_fit"]}})
    if "netbed" in profile:
        out["netbed"] = profile["netbed"]
    return out


def _recorded_sync_work_s(method: dict, path) -> float | None:
    """The work per call of the loop a profile's ``sync_s`` was measured on, as its ``method.sync_fit`` recorded it
    (``work_s``), for a profile written before ``sync_work_s`` was a rate of its own; ``None`` where it recorded
    none (every call then waits all of ``sync_s``, as before)."""
    fit = method.get("sync_fit")
    work = fit.get("work_s") if isinstance(fit, dict) else None
    if work is None:
        return None
    if isinstance(work, bool) or not isinstance(work, (int, float)) or not math.isfinite(work) or work < 0:
        raise InvalidValueError(f"--calls-into: the host profile {str(path)!r} records method.sync_fit.work_s "
                                f"{work!r}, not seconds >= 0; calibrate it again (python -m sparsecomm.netbed "
                                f"calibrate)")
    return float(work)


def shared_costs(host: HostModel, quick: bool = False) -> dict:
    """The rates of :data:`~.sim_host.SHARED_RATES` fitted with :data:`PEER_WORKERS` processes on this machine's
    cores (module docstring), as ``by_share`` (``{share: rates}``: none where the processes do not outnumber the
    cores), with the measurements (``shared_fit``: the workers, the cores and the share; the exchanges', the native
    fit's and the calls' own records). ``host``: the model with every rate fitted between two processes, in which
    the measurements are modelled (its ``by_share`` replaced)."""
    import dataclasses

    cores, n = os.cpu_count() or 1, PEER_WORKERS
    share = n / cores
    fit: dict = {"workers": n, "cores": cores, "share": max(1.0, share)}
    if share <= 1.0:
        return {"by_share": {}, "shared_fit": fit}
    # (the calls modelled without the per-call costs being fitted, nor a wait for a last worker, as call_costs
    # models them between two processes: sync_s is measured after them, with them in the model)
    host = dataclasses.replace(host, call_s={k: v for k, v in host.call_s.items() if k not in CALL_GROUPS[()]},
                               sync_s=0.0, by_share={})
    messages = message_costs(quick, workers=n, share=share)
    fit["message_fit"] = messages["fit"]
    rates = {k: messages[k] for k in ("message_cpu_s", "message_wait_s")}
    natives = native_costs(dataclasses.replace(host, by_share={share: rates}), quick, workers=n)
    fit["native_fit"] = natives.pop("native_fit")
    rates.update(natives)
    # (the calls of the transports that need no service: their processes are the workers alone, at this share)
    calls = call_costs(dataclasses.replace(host, by_share={share: rates}), quick, workers=n,
                       groups={(): CALL_GROUPS[()]})
    fit["call_fit"] = calls["call_fit"]
    # (a call's residual is wall time, the model stretches its call_s by the share: call_costs gives the residual
    # over it)
    rates["call_s"] = calls["call_s"]
    return {"by_share": {share: rates}, "shared_fit": fit}


def shared_into(path: str | Path, quick: bool = False) -> dict:
    """The profile at ``path`` with its rates by share of the cores measured on this machine (:func:`shared_costs`,
    with the profile's other rates) in place of its own, and ``sync_s`` measured again with them
    (:func:`sync_costs`: the loop it times is modelled with those rates), the measurements as its ``method``'s
    ``shared_fit`` and ``sync_fit`` (``--shared-into``)."""
    import dataclasses

    profile = load_profile(path)
    host = dataclasses.replace(host_from_profile(profile, f"host profile {str(path)!r}"), by_share={})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shared = shared_costs(host, quick)
        host = dataclasses.replace(host, by_share=shared["by_share"])
        sync = sync_costs(host, quick)
    finally:
        torch.set_num_threads(threads)
    method = {**profile.get("method", {}), "shared_fit": shared["shared_fit"], "sync_fit": sync.pop("sync_fit")}
    out = profile_dict(dataclasses.replace(host, **sync), date=profile.get("date", ""),
                       machine=profile.get("machine", {}), method=method)
    if "netbed" in profile:
        out["netbed"] = profile["netbed"]
    return out


def machine() -> dict:
    """What the profile was measured on."""
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": 1}


def calibrate(quick: bool = False, netbed_gbps: float | None = NETBED_GBPS, pin_cores: bool = False) -> dict:
    """Measure this machine's host costs (module docstring) and return its profile (:mod:`.sim_profile`).

    Args:
        quick: fewer sizes, rounds and repeats (seconds rather than a minute; for tests, not for use).
        netbed_gbps: the link rate of the netbed whose per-message latency is measured (:func:`netbed_costs`),
            where this process may build one (root: :func:`~.topology.check_privileges`); ``None``: not
            measured (the profile has no ``netbed``).
        pin_cores: the calls between processes that the sparse switch's and the transports' per-call costs are
            fitted on run on pinned ranks (:func:`sparsecomm.launch`'s option; ``method.pin_cores``): the profile
            of runs on pinned ranks (``netbed_vs_sim --pin-cores``).
    """
    from ..errors import NetbedError
    from .topology import check_privileges

    if netbed_gbps is not None:
        try:
            check_privileges()
        except NetbedError as exc:
            print(f"calibrate: the netbed's latency is not measured: {exc}", file=sys.stderr)
            netbed_gbps = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels = kernel_costs(quick)
        fresh = fresh_costs(quick)
        fresh_fit = fresh.pop("fresh_fit")
        kernels.update(fresh)
        messages = message_costs(quick)
        fit = messages.pop("fit")
        switch_fit = kernels.pop("switch_fit")
        sparse_switch_fit = kernels.pop("sparse_switch_fit")
        blocks = block_costs(HostModel(**messages, **kernels), quick)
        block_fit = blocks.pop("block_fit")
        rounds = sparse_switch_round_costs(HostModel(**messages, **kernels, **blocks), quick, pin_cores)
        round_fit = rounds.pop("sparse_switch_round_fit")
        natives = native_costs(HostModel(**messages, **kernels, **blocks, **rounds), quick)
        native_fit = natives.pop("native_fit")
        peers = peer_call_costs(HostModel(**messages, **kernels, **blocks, **rounds, **natives), quick)
        peer_fit = peers.pop("call_peer_fit")
        calls = call_costs(HostModel(**messages, **kernels, **blocks, **rounds, **natives, **peers), quick, pin_cores)
        call_fit = calls.pop("call_fit")
        shared = shared_costs(HostModel(**messages, **kernels, **blocks, **rounds, **natives, **peers, **calls), quick)
        shared_fit = shared.pop("shared_fit")
        sync = sync_costs(HostModel(**messages, **kernels, **blocks, **rounds, **natives, **peers, **calls, **shared),
                          quick)
        sync_fit = sync.pop("sync_fit")
        contention = contention_costs(quick)
        contention_fit = contention.pop("contention_fit")
        netbed = None if netbed_gbps is None else netbed_costs(netbed_gbps, quick)
    finally:
        torch.set_num_threads(threads)
    host = HostModel(**messages, **kernels, **blocks, **rounds, **natives, **peers, **calls, **shared, **sync,
                     **contention)
    date = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    method = {"quick": bool(quick), "repeats": REPEATS[quick], "exchanges": ROUNDS[quick],
              "elements": ELEMENTS[quick], "turn_vectors": TURN_VECTORS, "message_fit": fit, "switch_fit": switch_fit,
              "sparse_switch_fit": sparse_switch_fit, "fresh_fit": fresh_fit,
              "block_fit": block_fit, "sparse_switch_round_fit": round_fit, "native_fit": native_fit,
              "launches": LAUNCHES[quick], "peer_launches": PEER_LAUNCHES[quick], "pin_cores": bool(pin_cores),
              "call_elems": CALL_ELEMS, "call_elems_of": dict(CALL_ELEMS_OF), "calls": CALLS[quick],
              "call_fit": call_fit, "shared_fit": shared_fit, "sync_fit": sync_fit,
              "contention_fit": contention_fit,
              "call_peer_workers": PEER_WORKERS, "call_peer_fit": peer_fit,
              "statistic": "median", "messages_via": "TorchFabric irecv/isend exchanges over gloo, 127.0.0.1",
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if netbed is not None:
        method["netbed_fit"] = {k: netbed.pop(k) for k in ("netbed_s", "loopback_s", "load_average")}
    return profile_dict(host, date=date, machine=machine(), method=method, netbed=netbed)


def write_profile(profile: dict, out: str | Path) -> None:
    """Write ``profile`` as JSON to ``out``."""
    Path(out).write_text(json.dumps(profile, indent=2) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The calibrate command's options."""
    p.add_argument("--out", required=True, help="where to write the host profile (JSON)")
    p.add_argument("--quick", action="store_true", help="fewer repeats (seconds; for tests)")
    p.add_argument("--netbed-gbps", type=float, default=NETBED_GBPS,
                   help="the link rate of the 2-host netbed whose per-message latency is measured (needs root; "
                        "default %(default)g)")
    p.add_argument("--no-netbed", action="store_true", help="do not measure the netbed's latency")
    p.add_argument("--pin-cores", action="store_true",
                   help="fit the sparse switch's and the transports' per-call costs on pinned ranks (each on a core "
                        "of its own turn): the profile of runs on pinned ranks (netbed_vs_sim --pin-cores)")
    p.add_argument("--shared-into", default=None, metavar="PROFILE",
                   help="measure only the rates by share of the cores (by_share, with 4 processes; loopback, no "
                        "netbed) and sync_s again with the other rates of PROFILE, and write PROFILE with them (and "
                        "their measurements under method.shared_fit and method.sync_fit) to --out")
    p.add_argument("--calls-into", default=None, metavar="PROFILE",
                   help="measure nothing: fit call_s again to the calls PROFILE recorded (method.call_fit), modelled "
                        "with this code and PROFILE's other rates, and write PROFILE with it to --out")
    p.add_argument("--sync-into", default=None, metavar="PROFILE",
                   help="measure only sync_s (loopback, no netbed) with the rates of PROFILE, and write PROFILE with "
                        "it (and its measurement under method.sync_fit) to --out")


def run(args: argparse.Namespace) -> int:
    """The calibrate command: measure, write ``--out``, print the rates."""
    if args.shared_into is not None:
        profile = shared_into(args.shared_into, args.quick)
        write_profile(profile, args.out)
        for share, rates in profile.get("by_share", {}).items():
            for name, entry in rates.items():
                value = entry["value"]
                shown = (", ".join(f"{k} {v:.3g}" for k, v in value.items()) if isinstance(value, dict)
                         else f"{value:.3g}")
                print(f"share {share}: {name}: {shown} {entry['unit']}")
        print(f"sync_s: {profile['host']['sync_s']['value']:.3g} s/call")
        print(f"wrote {args.out}")
        return 0
    if args.calls_into is not None:
        profile = calls_into(args.calls_into)
        write_profile(profile, args.out)
        for name, v in profile["host"]["call_s"]["value"].items():
            print(f"call_s {name}: {v:.3g} s/call")
        print(f"wrote {args.out}")
        return 0
    if args.sync_into is not None:
        profile = sync_into(args.sync_into, args.quick)
        write_profile(profile, args.out)
        print(f"sync_s: {profile['host']['sync_s']['value']:.3g} s/call; {profile['method']['sync_fit']}")
        print(f"wrote {args.out}")
        return 0
    profile = calibrate(args.quick, None if args.no_netbed else args.netbed_gbps, args.pin_cores)
    write_profile(profile, args.out)
    for name, entry in profile["host"].items():
        value = entry["value"]
        shown = (", ".join(f"{k} {v:.3g}" for k, v in value.items()) if isinstance(value, dict)
                 else str(value) if isinstance(value, int) else f"{value:.3g}")
        print(f"{name}: {shown} {entry['unit']}")
    if "netbed" in profile:
        nb = profile["netbed"]
        print(f"netbed latency_s: {nb['latency_s']['value']:.3g} {nb['latency_s']['unit']} "
              f"({nb['hosts']} hosts, {nb['gbps']:g} Gbit/s)")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsecomm.netbed.calibrate",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
