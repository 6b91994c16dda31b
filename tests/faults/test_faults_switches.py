"""Faults of the SwitchML transports (``switch``, ``sparse-switch``) on real gloo processes: every rank gets
the library's error class within ``BOUND`` seconds under a ``TIMEOUT`` fabric timeout (never the timeout
itself, an abort or a silently wrong number). Every rank runs under the address-space cap of the fault
suite.

- ``sparse-switch`` against another transport: its workers exchange the fixed-size agreement header every
  transport exchanges before any packet goes to the switch (:mod:`sparsecomm.transports._handshake`), so a
  ring / native / omnireduce / switch worker reads it as its own transport's header: ``MismatchError``
  naming both transports.
- A peer whose packets are corrupted on the way, or a sparse-switch peer that breaks its look-ahead: the
  switch reports what it drops, a worker that refuses what it receives stops every rank.
- DDP with a switch service: over the workers' group it runs; over the default group ``register`` refuses.
- A job started as torchrun starts it (launch in place): every process exits with status 0.
(The values -- fp16 sums, a huge value among small ones -- are the same on every fabric: ``test_faults.py``.)
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401

from tests._faults_common import CorruptingFabric, cap_address_space, outcome, switch_corruption

pytestmark = pytest.mark.multiprocess

TIMEOUT = 30.0
BOUND = 5.0       # seconds: every rank must have its error well within this (vs TIMEOUT)
REPO = Path(__file__).resolve().parents[2]


def _sparse_vs(ctx, other: str, odd: int):
    cap_address_space()
    f = ctx.fabric
    sparse = sc.transports.get("sparse-switch", f, pool_size=4, slot_elems=64)
    good = sparse.allreduce(torch.ones(300) * (ctx.rank + 1))      # the sparse switch works before the mistake
    ok = torch.equal(good, torch.full((300,), float(sum(range(1, f.world_size + 1)))))
    if ctx.rank == odd:
        kw = {"block_size": 16, "lanes": 8} if other == "omnireduce" else {"pool_size": 4} if other == "switch" else {}
        t = sc.transports.get(other, f, **kw)
    else:
        t = sparse
    return ok, outcome(lambda: t.allreduce(torch.ones(640)))


@pytest.mark.parametrize("other, n, odd", [("ring", 2, 1), ("omnireduce", 3, 0), ("switch", 2, 0),
                                           ("native", 3, 2)])
def test_sparse_switch_vs_another_transport_is_a_mismatch_error_on_every_rank_quickly(other, n, odd):
    services = ["sparse-switch:elems=64"] + (["switch"] if other == "switch" else [])
    res = sc.launch(functools.partial(_sparse_vs, other=other, odd=odd), n, backend="gloo", timeout_s=TIMEOUT,
                    services=services)
    assert all(ok for ok, _ in res), res
    got = [o for _, o in res]
    assert [o[0] for o in got] == ["MismatchError"] * n, got
    assert all(o[2] < BOUND for o in got), got
    for _, msg, _ in got:
        assert "disagree on the transport" in msg and "'sparse-switch'" in msg and f"'{other}'" in msg, msg


# ----------------------------------------------------------------------------- a corrupting peer
def _corrupt(ctx, name: str, words: int):
    cap_address_space()
    f = CorruptingFabric(ctx.fabric, switch_corruption(words)) if ctx.rank == 1 else ctx.fabric
    t = sc.transports.get(name, f, pool_size=4)
    return outcome(lambda: t.allreduce(torch.ones(3000) * (ctx.rank + 1)))


@pytest.mark.parametrize("name, words", [("switch", 4), ("sparse-switch", 2)])
def test_a_peer_whose_switch_packets_are_corrupted_stops_every_rank_quickly(name, words):
    """Worker 1's messages to the switch have their first int32 words (the first row's header: its type,
    slot, ...) rewritten to 0x7fffffff. The switch drops what it cannot parse and tells every worker, who
    stop the job: MalformedMessage naming worker 1 on every rank, not the switch's slots waiting for the
    contribution that never comes until the timeout."""
    res = sc.launch(functools.partial(_corrupt, name=name, words=words), 3, backend="gloo", timeout_s=TIMEOUT,
                    services=[name])
    assert [o[0] for o in res] == ["MalformedMessage"] * 3, res
    assert all(o[2] < BOUND and "worker 1" in o[1] for o in res), res


# ----------------------------------------------------------------------------- a lying sparse-switch peer
def _lie(ctx, mode: str, liar: int = 1):
    """Worker ``liar`` rewrites its own well-formed packets on the wire: ``hide``: its look-ahead (MIN) packet
    announces no block in any lane, which it then sends; ``next``: its stream packets announce no next
    block, then it has one; ``step``: its MIN packet claims position 5 (the round is at 0)."""
    from sparsecomm.transports.switchml.sparse import dataplane as sdp

    cap_address_space()
    f = ctx.fabric
    if ctx.rank == liar:
        def rw(t, dst, tag):
            if tag != sdp.TAG_UP or t.dtype != torch.int32:
                return None
            out = t.detach().clone()
            rows = out.numpy().reshape(-1, t.shape[-1])
            kinds = sdp.unpack_w0(rows[:, sdp.W0])[0]
            if mode == "next":
                rows[((kinds == sdp.T_DATA) | (kinds == sdp.T_SKIP)) & (rows[:, sdp.F_SLOT] != 0), sdp.F_NEXT] = sdp.NONE
            elif mode == "hide":
                rows[kinds == sdp.T_MIN, sdp.HEADER + 1:] = sdp.NONE
            else:
                rows[kinds == sdp.T_MIN, sdp.F_POS] = 5
            return out
        f = CorruptingFabric(f, rw)
    t = sc.transports.get("sparse-switch", f, pool_size=4)
    x = torch.zeros(16, 256)
    x[ctx.rank::3] = ctx.rank + 1.0            # every lane has blocks of every worker
    return outcome(lambda: t.allreduce(x.reshape(-1)))


@pytest.mark.parametrize("mode, liar", [("hide", 1), ("next", 1), ("step", 1), ("step", 0)])
def test_a_sparse_switch_peer_breaking_its_look_ahead_stops_every_rank_quickly(mode, liar):
    """A look-ahead the sender then does not keep is a violated invariant: the liar's own check sees the
    agreed lane start (or next position) pass a block it holds; a position out of step is refused by the
    switch, which tells every worker. Either way every rank stops with ProtocolError, not a stall. Out of
    step, the switch cannot tell whether the refused packet or those that opened the round are the forged
    ones (the liar's may come first and open it): the error names both sides, so the liar among them."""
    res = sc.launch(functools.partial(_lie, mode=mode, liar=liar), 3, backend="gloo", timeout_s=TIMEOUT,
                    services=["sparse-switch"])
    assert [o[0] for o in res] == ["ProtocolError"] * 3, res
    assert all(o[2] < BOUND for o in res), res
    if mode == "step":
        assert all(f"worker {liar}" in o[1] and "the sender of the wrong packet is unknown" in o[1]
                   for o in res), res


# ----------------------------------------------------------------------------- a switch that a burst aborts
def _burst(ctx, name: str, how: str):
    """After a good call (kernels compiled, connections open), worker 1 sends the switch a message one burst
    longer than the switch's receive (``RECV_SLACK`` bursts at the switch, one at the sparse switch): gloo
    aborts the switch's process. ``stream``: the message replaces worker 1's first packet message of the
    next call; ``direct``: worker 1 sends it on its own, then calls."""
    from sparsecomm.transports.switchml import dataplane as dp
    from sparsecomm.transports.switchml.sparse import dataplane as sdp

    cap_address_space()
    torch.set_num_threads(1)
    up = dp.TAG_UP if name == "switch" else sdp.TAG_UP
    armed = []

    def rw(x, dst, tag):
        if armed and tag == up and x.dtype == torch.int32:
            m = x.detach().reshape(-1, x.shape[-1])
            return m.repeat(-(-armed[0] // m.shape[0]), 1)
    f = CorruptingFabric(ctx.fabric, rw) if ctx.rank == 1 and how == "stream" else ctx.fabric
    t = sc.transports.get(name, f, pool_size=4)
    good = t.allreduce(torch.ones(3000)).tolist() == [3.0] * 3000
    rows = ((dp.RECV_SLACK if name == "switch" else 1) + 1) * t.config.burst
    if ctx.rank == 1 and how == "direct":
        head = dp.HEADER if name == "switch" else sdp.HEADER
        big = torch.zeros((rows, head + t.config.elems), dtype=torch.int32)
        return good, outcome(lambda: (f.send(big, t.switch, up), t.allreduce(torch.ones(3000))))
    armed.append(rows)
    return good, outcome(lambda: t.allreduce(torch.ones(3000)))


@pytest.mark.parametrize("name, how", [("switch", "stream"), ("switch", "direct"), ("sparse-switch", "stream"),
                                       ("sparse-switch", "direct")])
def test_a_switch_that_a_longer_message_aborts_is_a_failure_of_the_switch_on_every_rank_at_once(name, how):
    """gloo aborts a process that receives a message longer than its receive: the switch's process dies
    as under kill -9, and every worker -- the sender of the message too -- gets PeerFailure naming the
    switch within a second, not at the timeout."""
    res = sc.launch(functools.partial(_burst, name=name, how=how), 3, backend="gloo", timeout_s=TIMEOUT,
                    services=[name])
    assert all(good for good, _ in res), res
    got = [o for _, o in res]
    assert [o[0] for o in got] == ["PeerFailure"] * 3, got
    assert all(f"service {name!r}" in o[1] for o in got), got
    assert all(o[2] < 1.0 for o in got), [o[2] for o in got]


# ----------------------------------------------------------------------------- DDP with a switch service
def _ddp(ctx):
    from torch import nn

    cap_address_space()
    workers = ctx.fabric.native_group          # the workers' group: the default one holds the switches too
    out = {}
    for name in ("ring", "switch", "sparse-switch"):
        torch.manual_seed(0)
        net = nn.parallel.DistributedDataParallel(nn.Linear(8, 1), process_group=workers)
        group = workers if name == "switch" else None          # both spellings of the launch's group
        sc.ddp.register(net, process_group=group, transport=name, verify_replicas_every=1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(ctx.rank))
        for _ in range(3):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        out[name] = net.module.weight.detach().clone()
    # a model over the default group (init_sync=False: its construction would wait for the switches)
    net = nn.parallel.DistributedDataParallel(nn.Linear(8, 1), init_sync=False)
    out["default group"] = outcome(lambda: sc.ddp.register(net, transport="switch"))
    return out


def test_ddp_over_the_workers_group_runs_the_switch_transports_and_the_default_group_is_refused():
    res = sc.launch(_ddp, 2, backend="gloo", timeout_s=TIMEOUT, services=["switch", "sparse-switch"])
    for name in ("switch", "sparse-switch"):
        assert torch.equal(res[0][name], res[1][name]), name                    # replicas identical
        assert torch.allclose(res[0][name], res[0]["ring"], atol=1e-6), name    # the fixed-point sum's bound
    refused = [r["default group"] for r in res]
    assert [o[0] for o in refused] == ["IncompatibleError"] * 2, refused
    assert all("process_group=ctx.fabric.native_group" in o[1] and o[2] < BOUND for o in refused), refused


# ----------------------------------------------------------------------------- a clean exit, in place
EXIT_SCRIPT = '''
import os, sys, time, torch
import sparsecomm as sc
import sparsecomm.transports

NAME, MARK = sys.argv[1], "finalizing"


class LateExit:
    """A module global of the service rank, so deleted while its interpreter finalizes: it marks that
    moment and stays in it, so that the workers' exits (their connections closing) land there."""

    def __del__(self, _open=open, _sleep=time.sleep, _mark=MARK):     # builtins may be gone by then
        _open(_mark, "w").close()
        _sleep(2.0)


def fn(ctx):
    t = sc.transports.get(NAME, ctx.fabric, pool_size=4)
    return t.allreduce(torch.full((1000,), float(ctx.rank + 1)))[:2].tolist()


if __name__ == "__main__":
    torch.set_num_threads(1)
    res = sc.launch(fn, 2, backend="gloo", services=[NAME], timeout_s=30)
    with open(f"result{os.environ['RANK']}.txt", "w") as fh:
        fh.write(repr(res))
    if int(os.environ["RANK"]) == 2:
        late = LateExit()
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(MARK) and time.monotonic() < deadline:
            time.sleep(0.01)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["switch", pytest.param("sparse-switch", marks=pytest.mark.slow)])
def test_every_process_of_a_switch_job_started_as_torchrun_does_exits_cleanly(name, tmp_path):
    """Two workers and the switch, each a process started with torch.distributed's environment variables
    (launch runs in place, as under torchrun): the job is right and every process exits with 0. The
    service rank's interpreter stays in its finalization while the workers exit (LateExit), where a
    thread of it still blocked in a receive from them woke and aborted the process (SIGABRT, 134)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    port = _free_port()
    procs = []
    try:
        for rank in range(3):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, str(script), name], cwd=tmp_path, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 150
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0, 0], (codes, outs)
    results = [(tmp_path / f"result{r}.txt").read_text() for r in range(3)]
    assert results == ["[[3.0, 3.0], [3.0, 3.0]]"] * 3, results
