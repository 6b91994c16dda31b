"""The ``sparse-switch`` transport on SimFabric: exact sums of block-sparse data with and without loss,
contributions counted once, only the union's blocks carried, bytes against the ideal, the switch's
declared state, forged packets and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.errors import (IncompatibleError, MismatchError, NonFiniteError, OverflowError_, ProtocolError,
                               SparseCommError)
from sparsecomm.transports.switchml.sparse import dataplane as dp
from sparsecomm.transports.switchml.sparse import INT32_MAX

K = 256


def blocky(rank: int, numel: int, density: float, *, seed: int = 0, overlap: str = "random",
           ints: bool = True, k: int = K) -> torch.Tensor:
    """Block-sparse data: each block non-zero with probability ``density``, drawn per worker
    (``overlap="random"``: partial overlap) or shared (``"full"``); values random, exactly zero elsewhere."""
    nb = -(-numel // k)
    pos = np.random.default_rng([seed, 0 if overlap == "full" else rank + 1])
    m = pos.random(nb) < density
    val = np.random.default_rng([seed, 1000 + rank])
    x = np.zeros((nb, k), dtype=np.float64)
    x[m] = val.integers(-(2**20), 2**20, (int(m.sum()), k)) if ints else val.standard_normal((int(m.sum()), k))
    x = torch.from_numpy(x.reshape(-1)[:numel])
    return x.to(torch.int32) if ints else x.to(torch.float32)


def _run(n, make, *, loss=0.0, seed=1, **kw):
    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, **kw)
        x = make(ctx.rank)
        y = t.allreduce(x)
        return x, y, t.last_stats, t.last_info, t.last_fixed, t.dataplane

    net = sc.Network(bandwidth_gbps=100, latency_us=2, loss=loss, seed=seed)
    return sc.launch(fn, n, network=net)


def _union_blocks(xs, k=K) -> int:
    return int(np.logical_or.reduce([codec.nonzero_blocks(x, k).numpy() for x in xs]).sum())


# ----------------------------------------------------------------------------- exactness
CASES = [  # (n, numel, density, overlap)
    (3, 256 * 40 + 17, 0.2, "random"),      # odd n, odd length, partial overlap
    (4, 256 * 33, 0.0, "random"),           # all zero: nothing but the two set-up rounds
    (2, 256 * 9 + 1, 1.0, "random"),        # dense, a one-element last block
    (5, 1001, 0.5, "full"),                 # every worker the same blocks
    (1, 257, 0.5, "random"),                # a single worker
]


@pytest.mark.parametrize("loss", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("n,numel,density,overlap", CASES)
def test_integer_sums_are_exact_with_and_without_loss(n, numel, density, overlap, loss):
    out = _run(n, lambda r: blocky(r, numel, density, overlap=overlap), loss=loss, pool_size=8, audit=True)
    xs = [o[0] for o in out]
    exact = torch.stack([x.long() for x in xs]).sum(0)
    for _, y, *_ in out:
        assert y.dtype == torch.int32 and torch.equal(y.long(), exact)
    # every contribution counted exactly once, however many packets were retransmitted
    plane = out[0][5]
    assert set(plane.audit.values()) <= {1}
    union = _union_blocks(xs)
    rounds = out[0][3]["stream"]["results"] if "stream" in out[0][3] else 0
    assert rounds == union                          # one round per union block, no more
    assert all(o[3].get("stream", {}).get("data", 0) == int(codec.nonzero_blocks(o[0], K).sum()) for o in out)
    assert plane.stats["empty"] == 0 and plane.stats["overflow"] == 0
    if loss >= 0.05 and union:
        assert sum(o[3]["stream"]["retransmissions"] for o in out) > 0   # the loss was exercised


def test_float_sums_are_the_sum_of_the_workers_codes_and_within_the_bound():
    n, numel = 3, 256 * 20 + 5

    def make(r):
        x = blocky(r, numel, 0.3, ints=False)
        return x * 2.0 ** (r - 4)                  # workers of different magnitudes

    for loss in (0.0, 0.05):
        out = _run(n, make, loss=loss, pool_size=4)
        xs = [o[0] for o in out]
        f = out[0][4]
        for _, y, _, _, fx, _ in out:               # every worker the same bits
            assert torch.equal(y, out[0][1]) and torch.equal(fx.sums, f.sums)
        e = max(max(-126, int(codec.chunk_exponents(x, numel)[0])) for x in xs)
        assert f.exponent == e
        assert f.scale == float(codec.scale_from_exponents(torch.tensor([e]), n)[0])
        codes = sum(codec.to_fixed(x, f.scale).long() for x in xs)
        assert torch.equal(f.sums.long(), codes) and int(codes.abs().max()) <= INT32_MAX
        exact = torch.stack(xs).double().sum(0)
        err = (out[0][1].double() - exact).abs()
        assert (err <= n * 0.5 / f.scale + exact.abs() * 2.0**-23).all()


def test_consecutive_jobs_of_various_sizes_under_loss_keep_the_sets_in_step():
    sizes = (256 * 30 + 3, 1, 256 * 7, 0, 256 * 64)

    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=6, slot_elems=64)
        res = []
        for j, m in enumerate(sizes):
            x = blocky(ctx.rank, m, 0.3, seed=j, k=64)
            res.append((x, t.allreduce(x)))
        return res

    out = sc.launch(fn, 3, network=sc.Network(loss=0.03, seed=5))
    for j in range(len(sizes)):
        exact = sum(o[j][0].long() for o in out)
        assert all(torch.equal(o[j][1].long(), exact) for o in out)


# ----------------------------------------------------------------------------- traffic
#: a switch slower than the 1 ms timer, with no cost per message (SimFabric's datagrams and timers): a wave of
#: packets queues at the switch for longer than the timer, so workers retransmit packets that were not lost
SLOW_SWITCH = sc.HostModel(switch_message_s=2e-5)


@pytest.mark.parametrize("n,densities,ints", [(2, (1.0, 0.5), True), (4, (1.0, 0.1), True), (4, (0.3,), True),
                                              (4, (1.0, 0.5), False)])
def test_a_switch_slower_than_the_timer_takes_each_workers_packets_in_order(n, densities, ints):
    """A worker's retransmitted skip (its own tag) queued at the switch behind that worker's packet of the slot's
    next round must not be taken after it: the seen-bitmap would count it as the first packet of a new round
    (a block counted twice, a result announcing another round's next position, a refusal as out of step)."""
    numel = 256 * 64

    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=32, audit=True)
        out = []
        for j, d in enumerate(densities):
            x = blocky(ctx.rank, numel, d, seed=j, ints=ints)
            out.append((x, t.allreduce(x), t.last_info["stream"]["retransmissions"], t.last_fixed))
        return out, t.dataplane

    net = sc.Network(bandwidth_gbps=1e4, latency_us=0.0, host=SLOW_SWITCH)
    res = sc.launch(fn, n, network=net)
    assert sum(r[2] for o in res for r in o[0]) > 0            # the timers fired: packets were sent twice
    assert set(res[0][1].audit.values()) == {1}                  # every contribution counted once
    for j in range(len(densities)):
        xs = [o[0][j][0] for o in res]
        ys = [o[0][j][1] for o in res]
        assert all(torch.equal(y, ys[0]) for y in ys)
        exact = torch.stack(xs).double().sum(0)
        if ints:
            assert torch.equal(ys[0].double(), exact)
        else:
            f = res[0][0][j][3]
            assert ((ys[0].double() - exact).abs() <= n * 0.5 / f.scale + exact.abs() * 2.0**-23).all()


@pytest.mark.parametrize("n,density,nb", [(4, 0.01, 4096), (4, 0.1, 4096), (8, 0.05, 2048), (3, 1.0, 1024)])
def test_bytes_are_own_blocks_up_and_union_down_within_5_percent(n, density, nb):
    numel = 256 * nb                                # up to 4 MiB of int32
    out = _run(n, lambda r: blocky(r, numel, density), pool_size=256)
    xs = [o[0] for o in out]
    union = _union_blocks(xs)
    L = 256
    for x, _, stats, info, _, plane in out:
        own = int(codec.nonzero_blocks(x, K).sum())
        # the ideal (OmniReduce's): own blocks up, the union's down, each with a 4-byte look-ahead,
        # plus every lane's first look-ahead each way
        ideal = (own + union) * (4 * K + 4) + 2 * 4 * L
        moved = stats.bytes_sent + stats.bytes_received
        assert ideal <= moved <= 1.05 * ideal, (moved / ideal, own, union)
    # the switch multicast exactly the union's blocks, plus the control packet and the look-ahead
    # round's ceil((L + 1) / k) packets
    assert plane.stats["multicast"] == union + 1 + -(-(L + 1) // K) and plane.stats["empty"] == 0


# ----------------------------------------------------------------------------- the switch's state
def test_switch_state_stays_within_what_it_declares():
    out = _run(3, lambda r: blocky(r, 256 * 50, 0.4), loss=0.02, pool_size=16, switch_slots=64)
    plane = out[0][5]
    assert plane.stats["consumed"] > 0
    held = plane.state_bits()
    s, k = 64, K
    assert held == plane.declared_bits() == s * 2 * (k * 32 + 64 + 7 + 32 + 32 + 1)
    assert 0 <= int(plane.count.min()) and int(plane.count.max()) < 64
    # the check can fail: anything else the emulation kept would be undeclared state
    plane.history = np.zeros(10)
    with pytest.raises(AssertionError, match="undeclared"):
        plane.state_bits()
    del plane.history
    plane.nxt = np.zeros((s, 3), dtype=np.int32)
    with pytest.raises(AssertionError, match="declared"):
        plane.state_bits()


def test_module_docstring_memory_arithmetic_matches_the_declared_registers():
    from sparsecomm.transports.switchml import sparse as sparse_switch

    plane = dp.Dataplane()
    values = plane.config.slots * 2 * plane.config.elems * 32
    assert values // 8 == 2 * 2**20 and "2 MiB" in sparse_switch.__doc__
    rest = plane.declared_bits() - values
    assert rest // 8 == 34 * 1024 and "34 KiB" in sparse_switch.__doc__
    assert "(64+7+32+32+1)" in sparse_switch.__doc__


# ----------------------------------------------------------------------------- the program, packet by packet
def _pkt(kind, slot, v, w, n, pos, nxt, vec=None, k=64, job=1):
    row = np.zeros(dp.HEADER if kind == dp.T_SKIP else dp.HEADER + k, dtype=np.int32)
    row[dp.W0] = dp.pack_w0(kind, v, w, n, job)
    row[dp.F_SLOT], row[dp.F_POS], row[dp.F_NEXT] = slot, pos, nxt
    if vec is not None:
        row[dp.HEADER:] = vec
    return row


def test_program_adds_holders_takes_min_lookahead_and_answers_duplicates():
    plane = dp.Dataplane(dp.SparseSwitchConfig(elems=64, slots=4))
    a = np.arange(64, dtype=np.int32)
    assert plane.process(_pkt(dp.T_DATA, 1, 0, 0, 3, 5, 9, a)) == (None, None)
    assert plane.process(_pkt(dp.T_SKIP, 1, 0, 1, 3, 5, 7)) == (None, None)
    dup = plane.process(_pkt(dp.T_SKIP, 1, 0, 1, 3, 5, 7))          # duplicate before completion: dropped
    assert dup == (None, None) and plane.stats["dropped"] == 1
    mc, uc = plane.process(_pkt(dp.T_DATA, 1, 0, 2, 3, 5, 12, 2 * a))
    assert uc is None and mc[dp.F_POS] == 5 and mc[dp.F_NEXT] == 7
    assert np.array_equal(mc[dp.HEADER:], 3 * a) and dp.unpack_w0(mc[dp.W0])[0] == dp.T_RESULT
    _, uc = plane.process(_pkt(dp.T_DATA, 1, 0, 2, 3, 5, 12, 2 * a))  # retransmission after completion
    assert np.array_equal(uc[dp.HEADER:], 3 * a) and dp.unpack_w0(uc[dp.W0])[0] == dp.T_RETRANSMIT
    # the next round of the slot takes the other set; a MIN round keeps the element-wise minimum
    plane.process(_pkt(dp.T_MIN, 1, 1, 0, 2, 0, dp.NONE, a))
    mc, _ = plane.process(_pkt(dp.T_MIN, 1, 1, 1, 2, 0, dp.NONE, 63 - a))
    assert np.array_equal(mc[dp.HEADER:], np.minimum(a, 63 - a))


@pytest.mark.parametrize("bad", ["worker", "size", "lookahead", "slot", "type", "step", "world"])
def test_program_drops_malformed_and_out_of_step_packets(bad):
    plane = dp.Dataplane(dp.SparseSwitchConfig(elems=64, slots=4))
    plane.world = 2            # the job's worker count, as the service knows it from its fabric
    a = np.ones(64, dtype=np.int32)
    plane.process(_pkt(dp.T_DATA, 1, 0, 0, 2, 5, 9, a))
    row = {"worker": _pkt(dp.T_DATA, 1, 0, 3, 2, 5, 9, a),       # worker id >= n
           "size": np.concatenate([_pkt(dp.T_DATA, 1, 0, 1, 2, 5, 9, a), [0]]).astype(np.int32),
           "lookahead": _pkt(dp.T_DATA, 1, 0, 1, 2, 5, 5, a),    # next must be after pos
           "slot": _pkt(dp.T_DATA, 7, 0, 1, 2, 5, 9, a),
           "type": _pkt(dp.T_RESULT, 1, 0, 1, 2, 5, 9, a),
           "step": _pkt(dp.T_DATA, 1, 0, 1, 2, 6, 9, a),           # another position of an open round
           "world": _pkt(dp.T_DATA, 2, 0, 3, 5, 5, 9, a)}[bad]     # 5 workers: never multicast to ranks 2..4
    assert plane.process(row) == (None, None)
    assert plane.stats["malformed" if bad != "step" else "out_of_step"] == 1
    assert int(plane.count[1, 0]) == 1 and np.array_equal(plane.values[1, 0], a)   # nothing was added


def test_a_forged_result_is_rejected_with_a_clear_error(monkeypatch):
    real = dp.Dataplane.answer

    def forged(self, *args):
        sends, results = real(self, *args)
        for msg, _, _ in sends:                    # the switch's replies as they leave
            rows = msg.numpy().reshape(-1, msg.shape[-1])
            late = (rows[:, dp.W0] & dp.KIND_BITS == dp.T_RESULT) & (rows[:, dp.F_POS] > 0)
            rows[late, dp.F_NEXT] = rows[late, dp.F_POS]     # a "next" that does not advance
        return sends, results

    monkeypatch.setattr(dp.Dataplane, "answer", forged)
    with pytest.raises(SparseCommError, match="forged|corrupted"):
        _run(2, lambda r: blocky(r, 256 * 40, 0.5), pool_size=2, timeout=1e-3, give_up_s=0.05)


def test_a_forged_next_position_past_the_tensor_is_rejected_with_a_clear_error(monkeypatch):
    """161 blocks in 2 lanes (81 positions each): lane 1's position 80 would be block 161, past the tensor's last.
    A result announcing it is a forged one (the program never does), refused before any block is taken (was taken:
    its sums written over the last block's)."""
    real = dp.Dataplane.answer

    def forged(self, *args):
        sends, results = real(self, *args)
        for msg, _, _ in sends:
            rows = msg.numpy().reshape(-1, msg.shape[-1])
            first = (rows[:, dp.W0] & dp.KIND_BITS == dp.T_RESULT) & (rows[:, dp.F_POS] == 0)
            rows[first, dp.F_NEXT] = 80            # position 80 of every lane: block 160 (lane 0), 161 (lane 1)
        return sends, results

    def two_blocks(rank):
        x = torch.zeros(161 * K)
        x[:2 * K] = rank + 1.0                    # blocks 0 and 1: position 0 of lanes 0 and 1, nothing after
        return x

    monkeypatch.setattr(dp.Dataplane, "answer", forged)
    with pytest.raises(ProtocolError, match="lane 1's result announces next position 80 .*forged"):
        _run(2, two_blocks, pool_size=2, timeout=1e-3, give_up_s=0.05)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("case,err", [("nan", NonFiniteError), ("length", MismatchError),
                                      ("dtype", MismatchError), ("int_overflow", OverflowError_)])
def test_bad_input_raises_the_same_error_on_every_worker_and_recovers(case, err):
    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=4)
        x = torch.ones(300)
        if case == "nan" and ctx.rank == 1:
            x[7] = float("nan")
        if case == "length" and ctx.rank == 0:
            x = torch.ones(301)
        if case == "dtype" and ctx.rank == 2:
            x = torch.ones(300, dtype=torch.float64)
        if case == "int_overflow":
            x = torch.full((300,), 2**30, dtype=torch.int32)
        try:
            t.allreduce(x)
            got = None
        except SparseCommError as e:
            got = type(e)
        return got, t.allreduce(torch.ones(10))     # the next job works

    for got, y in sc.launch(fn, 3):
        assert got is err and torch.equal(y, torch.full((10,), 3.0))


def test_invalid_arguments():
    def fn(ctx):
        errs = []
        for kw in ({"pool_size": 0}, {"pool_size": 1024}, {"slot_elems": 100}, {"timeout": -1.0}):
            try:
                sc.transports.get("sparse-switch", ctx.fabric, **kw)
            except ValueError as e:
                errs.append(str(e))
        return errs

    errs = sc.launch(fn, 1)[0]
    assert len(errs) == 4 and "pool_size" in errs[0] and "slot_elems" in errs[2]
    with pytest.raises(IncompatibleError, match="at most 64 workers"):     # (the widest bitmap: 1024, set low)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sc.transports.switchml.sparse, "MAX_WORKERS", 64)
            sc.launch(lambda ctx: sc.transports.get("sparse-switch", ctx.fabric), 65)
    cfg = dp.SparseSwitchConfig(elems=64, slots=128)
    assert cfg.spec() == "sparse-switch:elems=64,slots=128"
    assert dp.SparseSwitchConfig.parse("elems=64,slots=128") == cfg and dp.SparseSwitchConfig.parse(None) == dp.SparseSwitchConfig()
    with pytest.raises(ValueError, match="unknown"):
        dp.SparseSwitchConfig.parse("colour=3")


# ----------------------------------------------------------------------------- payload kinds
def test_payload_kinds_quantized_exact_aligned_checked_sparse_as_blocks():
    from sparsecomm.payload import Payload

    idx = torch.tensor([3, 17, 40, 99, 5])

    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=3, slot_elems=64)
        r = ctx.rank
        codes = torch.zeros(1000, dtype=torch.int32)
        codes[64 * r: 64 * r + 100] = torch.randint(-100, 100, (100,), generator=torch.Generator().manual_seed(r),
                                                    dtype=torch.int32)
        q = Payload("quantized", values=codes, shape=(1000,), dtype=torch.float32,
                    scale=torch.full((16,), 0.5), bucket_size=64, shared_scale=True)
        v = torch.tensor([1.0, -2.0, 3.5, 0.25, 8.0]) * (r + 1)
        a = Payload("aligned", values=v, indices=idx, shape=(100,), dtype=torch.float32)
        s = Payload("sparse", values=torch.tensor([1.0, 2.0]) * (r + 1), indices=torch.tensor([7, 64 * (r + 2) + 5]),
                    shape=(1000,), dtype=torch.float32)
        out = [t.allreduce(q), t.allreduce(a), t.allreduce(s),
               (t.last_info["stream"]["data"], t.last_info["stream"]["results"])]
        bad = Payload("aligned", values=v, indices=idx + r, shape=(200,), dtype=torch.float32)
        try:
            t.allreduce(bad)
        except MismatchError as e:
            out.append(str(e))
        return q, a, s, out

    res = sc.launch(fn, 3)
    for k in range(3):
        want = sum(r[k].to_dense().double() for r in res)
        for r in res:
            assert torch.allclose(r[3][k].double(), want, rtol=0, atol=1e-5)
    # sparse: only the blocks holding entries travel: 2 up from each worker, the union's 4 down
    assert [r[3][3] for r in res] == [(2, 4)] * 3
    assert all("shared indices" in r[3][4] for r in res)


def test_a_missing_worker_gives_a_timeout_not_a_hang():
    from sparsecomm.errors import FabricTimeout

    def fn(ctx):
        t = sc.transports.get("sparse-switch", ctx.fabric, pool_size=2, timeout=1e-3, give_up_s=0.02)
        try:
            t.allreduce(torch.ones(1000))
        except FabricTimeout as e:
            return str(e)

    # worker 1 dies silently after its agreement header (2 sends at n = 3) and its control packet
    out = sc.launch(fn, 3, network=sc.Network(crash={1: 3}))
    assert out[1] is None and all("unanswered" in o for o in (out[0], out[2]))
