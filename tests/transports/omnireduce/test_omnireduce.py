"""OmniReduce on SimFabric: exact sums, bytes on the wire against the ideal, payload kinds, errors.

Inputs are integer-valued float64 blocks at random positions that overlap partly across workers, so
every sum is exact and compared bit for bit; every worker rebuilds every worker's input from seeds.
Small lane counts force several rounds per channel, so the look-ahead stream is exercised.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import IncompatibleError, MismatchError, NonFiniteError
from sparsecomm.payload import Payload
from sparsecomm.transports.omnireduce import wire

NET = sc.Network(bandwidth_gbps=100, latency_us=2)


def block_mask(rank: int, nb: int, density: float, case: int) -> np.ndarray:
    """Half of the non-zero blocks shared by every worker, half the worker's own: partial overlap."""
    shared = np.random.default_rng([case, 10_000]).random(nb) < density / 2
    own = np.random.default_rng([case, rank]).random(nb) < density / 2
    if density >= 1.0:
        return np.ones(nb, dtype=bool)
    return shared | own


def make_x(rank: int, numel: int, bs: int, density: float, case: int, dtype=torch.float64) -> torch.Tensor:
    nb = -(-numel // bs)
    m = torch.from_numpy(block_mask(rank, nb, density, case)).repeat_interleave(bs)[:numel]
    g = torch.Generator().manual_seed(case * 1000 + rank)
    vals = torch.randint(1, 6, (numel,), generator=g) * (2 * torch.randint(0, 2, (numel,), generator=g) - 1)
    return torch.where(m, vals.to(dtype), torch.zeros((), dtype=dtype))


CASES = [  # numel, block_size, density, lanes, channels
    (10_000, 16, 0.3, 4, 2),    # 10000 % 16 != 0; 4 lanes -> many rounds
    (999, 32, 1.0, 3, 3),       # all dense, short last block
    (1_000, 7, 0.0, 8, 2),      # all zero: only round 0's metadata travels
    (5_000, 256, 0.5, 1024, 2),  # one round (lanes >= blocks per channel)
    (3, 256, 1.0, 4, 4),        # fewer blocks than aggregators x channels
    (0, 16, 1.0, 4, 2),         # empty
    (20_000, 64, 1.0, 4096, 2),  # one round, dense: whole channels travel as views, sums land in place
    (20_005, 64, 0.2, 4096, 3),  # one round, sparse, short last block
]


def _check(ctx, deployment, cases, calls=2, inplace=False, dtype=torch.float64):
    """Every case ``calls`` times (buffers reused); returns the problems found on this worker.
    ``inplace``: the sum must land in the input tensor itself."""
    n = ctx.world_size
    problems = []
    stats = []
    for i, (numel, bs, d, lanes, ch) in enumerate(cases):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=ch,
                              deployment=deployment, inplace=inplace)
        exp = sum(make_x(r, numel, bs, d, i, dtype) for r in range(n))
        for k in range(calls):
            x = make_x(ctx.rank, numel, bs, d, i, dtype) * (k + 1)
            y = t.allreduce(x)
            if y.dtype != dtype or not torch.equal(y, exp * (k + 1)):
                problems.append((deployment, n, i, k))
            if inplace and (y.data_ptr() != x.data_ptr() or not torch.equal(x, exp * (k + 1))):
                problems.append((deployment, n, i, k, "not in place"))
        stats.append(t.last_stats)
    return problems, stats


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sum_is_exact_on_every_worker(n, deployment):
    out = sc.launch(functools.partial(_check, deployment=deployment, cases=CASES), n, network=NET)
    assert [p for probs, _ in out for p in probs] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("n", [2, 3])
def test_inplace_sum_is_exact_and_lands_in_the_input(n, dtype):
    """In place (colocated): one-round float32/64 channels are summed by the hosted aggregator straight
    into the input, dense channels travel as views of it and their sums are received into it; float16
    (accumulated in float32) takes the copying path. Every case, twice on the same transport."""
    out = sc.launch(functools.partial(_check, deployment="colocated", cases=CASES, inplace=True, dtype=dtype),
                    n, network=NET)
    assert [p for probs, _ in out for p in probs] == []


def ideal_bytes(n: int, numel: int, bs: int, density: float, case: int, lanes: int, channels: int,
                deployment: str, itemsize: int = 8) -> list[tuple[int, int]]:
    """Per worker ``(sent, received)`` of the ideal stream: every worker's own non-zero blocks up, the
    union's non-zero blocks down (short last blocks travel padded), plus the index metadata: 4 bytes of
    look-ahead per block carried (each way), and in round 0 a 224-byte header and 4 bytes per lane (the
    first non-zero block of every lane) each way per (worker, aggregator). Colocated: the hosting
    worker's exchanges with its own aggregator do not cross the wire."""
    nb = -(-numel // bs)
    ms = [block_mask(r, nb, density, case) for r in range(n)]
    union = np.logical_or.reduce(ms)
    blk = bs * itemsize + 4
    plans = wire.plan(numel, bs, n, channels, lanes)
    per_agg = []   # (lo, hi, total lanes)
    for chans in plans:
        lo = chans[0].lo if chans else 0
        hi = chans[-1].lo + chans[-1].size if chans else 0
        per_agg.append((lo, hi, sum(c.lanes for c in chans)))
    h0 = [8 * wire.HDR + 4 * L for _, _, L in per_agg]
    out = []
    for w in range(n):
        up = [h0[a] + int(ms[w][lo:hi].sum()) * blk for a, (lo, hi, _) in enumerate(per_agg)]
        down = [h0[a] + int(union[lo:hi].sum()) * blk for a, (lo, hi, _) in enumerate(per_agg)]
        if deployment == "dedicated":
            out.append((sum(up), sum(down)))
        else:
            lo, hi, _ = per_agg[w]
            others_up = sum(h0[w] + int(ms[v][lo:hi].sum()) * blk for v in range(n) if v != w)
            out.append((sum(up) - up[w] + (n - 1) * down[w], sum(down) - down[w] + others_up))
    return out


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
@pytest.mark.parametrize("case", [0, 1, 3])
def test_bytes_on_the_wire_are_within_5_percent_of_the_ideal(deployment, case):
    n = 3
    numel, bs, d, lanes, ch = CASES[case]
    _, stats = zip(*sc.launch(functools.partial(_check, deployment=deployment, cases=[CASES[case]], calls=1),
                              n, network=NET))
    ideal = ideal_bytes(n, numel, bs, d, 0, lanes, ch, deployment)
    nb = -(-numel // bs)
    ms = [block_mask(r, nb, d, 0) for r in range(n)]
    for w in range(n):
        s = stats[w][0]
        sent, received = ideal[w]
        assert s.bytes_sent <= 1.05 * sent and s.bytes_received <= 1.05 * received, (w, s, ideal[w])
        # and no less than the blocks themselves: zero blocks never travel, non-zero ones always do
        own = int(ms[w].sum()) * bs * 8
        assert s.bytes_sent >= (own if deployment == "dedicated" else 0)
        union = int(np.logical_or.reduce(ms).sum()) * bs * 8
        if deployment == "dedicated":
            assert s.bytes_received >= union


def test_zero_blocks_never_travel_and_density_sets_the_volume():
    """All-zero input: only metadata. Halving the union halves the data bytes."""
    def fn(ctx, d):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=64, deployment="dedicated", lanes=16)
        x = torch.zeros(64 * 512, dtype=torch.float64)
        if d:
            x.view(512, 64)[: int(512 * d)] = 1.0     # the same blocks on every worker
        t.allreduce(x)
        return t.last_stats.bytes_received
    zero, half, full = (sc.launch(functools.partial(fn, d=d), 2)[0] for d in (0.0, 0.5, 1.0))
    blocks = 512 * (64 * 8 + 4)
    assert zero < 0.01 * blocks
    assert half - zero == pytest.approx(blocks / 2, rel=0.01)
    assert full - zero == pytest.approx(blocks, rel=0.01)


def _payloads(ctx, deployment):
    n, r = ctx.world_size, ctx.rank
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=8, lanes=4, deployment=deployment)
    out = []
    for mk in (_sparse, _aligned, _quantized, _dense16):
        mine = mk(r)
        y = t.allreduce(mine)
        exp = sum(mk(v).to_dense() for v in range(n)).reshape(mine.shape).to(mine.dtype)
        out.append((mk.__name__, torch.equal(y, exp), y.dtype, tuple(y.shape)))
    return out


def _sparse(r):
    g = torch.Generator().manual_seed(r)
    idx = torch.randint(0, 1000, (40,), generator=g)       # repeats add up
    return Payload("sparse", torch.randint(-3, 4, (40,), generator=g).double(), (10, 100), torch.float64,
                   indices=idx)


def _aligned(r):
    idx = torch.randperm(1000, generator=torch.Generator().manual_seed(7))[:50]
    vals = torch.randint(-3, 4, (50,), generator=torch.Generator().manual_seed(r)).double()
    return Payload("aligned", vals, (1000,), torch.float64, indices=idx)


def _quantized(r):
    codes = torch.randint(-127, 128, (1000,), generator=torch.Generator().manual_seed(r), dtype=torch.int8)
    codes[200:600] = 0
    scale = torch.pow(2.0, -torch.arange(10, dtype=torch.float64))
    return Payload("quantized", codes, (1000,), torch.float64, scale=scale, bucket_size=100, shared_scale=True)


def _dense16(r):
    v = torch.randint(-8, 9, (333,), generator=torch.Generator().manual_seed(r)).to(torch.float16)
    v[100:300] = 0
    return Payload("dense", v, (333,), torch.float32)


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_payload_kinds_sum_exactly(deployment):
    for res in sc.launch(functools.partial(_payloads, deployment=deployment), 3):
        assert [ok for _, ok, _, _ in res] == [True] * 4, res
        assert [(dt, sh) for _, _, dt, sh in res] == [(torch.float64, (10, 100)), (torch.float64, (1000,)),
                                                      (torch.float64, (1000,)), (torch.float32, (333,))]


def test_quantized_codes_travel_up_in_their_dtype_and_down_wide_enough():
    """int8 codes go up as int8 (1 byte each); 3 workers' sums need int16 on the way down."""
    def fn(ctx):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=100, lanes=100, deployment="dedicated")
        t.allreduce(_quantized(ctx.rank))
        return t.last_stats
    s = sc.launch(fn, 3)[0]
    blocks = 6          # 1000 codes, 400 zero: blocks 2..5 of 100 are zero, 6 of 10 non-zero
    # 3 aggregators: 3 headers; round-0 lane metadata (one block per lane here: a bitmap per channel);
    # 6 blocks of 100 int8 codes, without look-aheads (every lane's next block is "none"); first the
    # agreement handshake (ceil(log2 3) = 2 fixed-size headers)
    from sparsecomm.transports._handshake import HEADER_BYTES

    meta = sum(c.meta_bytes for chans in wire.plan(1000, 100, 3, 2, 100) for c in chans)
    assert meta == 6
    assert s.bytes_sent == 2 * HEADER_BYTES + 3 * 8 * wire.HDR + meta + blocks * 100
    assert s.bytes_received >= blocks * 100 * 2


def test_unshared_scale_is_rejected_naming_the_alternatives():
    def fn(ctx):
        t = sc.transports.get("omnireduce", ctx.fabric)
        p = _quantized(ctx.rank)
        p.shared_scale = False
        t.allreduce(p)
    with pytest.raises(IncompatibleError, match="allgather"):
        sc.launch(fn, 2)


def _mismatch(ctx, deployment):
    t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=4, deployment=deployment)
    msgs = []
    for x in (torch.ones(100 + (ctx.rank == 1)),                                  # length
              torch.ones(64, dtype=torch.float32 if ctx.rank == 2 else torch.float64)):  # dtype
        try:
            t.allreduce(x)
            msgs.append(None)
        except MismatchError as e:
            msgs.append(str(e))
    after = t.allreduce(torch.full((50,), float(ctx.rank)))   # the transport still works afterwards
    return msgs, after


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_mismatched_length_or_dtype_raises_on_every_worker(deployment):
    out = sc.launch(functools.partial(_mismatch, deployment=deployment), 3)
    for rank, (msgs, after) in enumerate(out):
        assert msgs[0] is not None and "numel" in msgs[0] and "100" in msgs[0] and "101" in msgs[0]
        assert msgs[1] is not None and "dtype" in msgs[1] and "float32" in msgs[1]
        assert f"this is worker {rank}" in msgs[0]
        assert torch.equal(after, torch.full((50,), 3.0))


def test_non_finite_values_raise_by_default_and_are_summed_as_floats_with_pass():
    def fn(ctx):
        x = torch.zeros(64)
        if ctx.rank == 0:
            x[3], x[40] = float("nan"), float("inf")
        else:
            x[40], x[50] = float("-inf"), 1.0
        try:
            sc.transports.get("omnireduce", ctx.fabric, block_size=16).allreduce(x)
            err = None
        except NonFiniteError as e:
            err = str(e)
        return err, sc.transports.get("omnireduce", ctx.fabric, block_size=16, nonfinite="pass").allreduce(x)
    for err, y in sc.launch(fn, 2):
        assert err is not None and "worker 0" in err
        assert torch.isnan(y[3]) and torch.isnan(y[40]) and y[50] == 1.0 and y[0] == 0


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_sums_raise_wherever_the_union_puts_them(inplace, dtype):
    """The guard checks only the blocks a call wrote (the union's; the rest of the result is zero): a NaN
    or an overflow in any of them, in every aggregator's range and in the short last block, still raises
    on every worker, in place (hosted channels summed in the input) or not, sparse or dense (every block
    written: one pass over the whole result); the finite rest passes."""
    from sparsecomm.errors import OverflowError_

    numel, bs = 16 * 40 + 5, 16            # 41 blocks, the last one short
    big = 60000.0 if dtype == torch.float16 else 3e38

    def fn(ctx):
        out = []
        for pos in (0, 16 * 13 + 2, 16 * 27 + 9, 16 * 39 + 7, 16 * 40 + 3):
            for kind in ("nan", "overflow", "finite", "dense nan"):
                x = torch.zeros(numel, dtype=dtype)
                x[16 * 20 + ctx.rank] = 1.0                          # another block of the union
                if kind == "dense nan":                              # every block written
                    x.fill_(1.0)
                if kind.endswith("nan") and ctx.rank == 1:
                    x[pos] = float("nan")
                elif kind != "nan":
                    x[pos] = big if kind == "overflow" else 1.0
                t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, inplace=inplace)
                try:
                    y = t.allreduce(x)
                    out.append((pos, kind, None, float(y[pos])))
                except (NonFiniteError, OverflowError_) as e:
                    out.append((pos, kind, type(e).__name__, str(e)))
        return out

    for rank_out in sc.launch(fn, 3):
        for pos, kind, err, detail in rank_out:
            if kind != "finite" and inplace:   # the inputs are overwritten: the cause cannot be named
                assert err == "NonFiniteError" and "summed in place" in detail, (pos, detail)
            elif kind.endswith("nan"):
                assert err == "NonFiniteError" and "worker 1" in detail, (pos, detail)
            elif kind == "overflow":
                assert err == "SumOverflowError", (pos, detail)
            else:
                assert err is None and detail == 3.0, (pos, detail)


def test_inplace_writes_the_sum_into_the_input_and_threshold_drops_small_blocks():
    def fn(ctx):
        x = torch.zeros(64)
        x[:16] = 1.0                  # a block above the threshold
        x[16:32] = 1e-3               # a block under it: dropped (and zeroed in place)
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, inplace=True, threshold=1e-2)
        y = t.allreduce(x)
        return y.data_ptr() == x.data_ptr(), x
    for same, x in sc.launch(fn, 2):
        assert same
        assert torch.equal(x, torch.cat([torch.full((16,), 2.0), torch.zeros(48)]))


def test_bad_arguments_and_the_service_registry():
    from sparsecomm.fabric import services

    with pytest.raises(ValueError, match="deployment"):
        sc.launch(lambda ctx: sc.transports.get("omnireduce", ctx.fabric, deployment="switch"), 1)
    with pytest.raises(ValueError, match="block_size"):
        sc.launch(lambda ctx: sc.transports.get("omnireduce", ctx.fabric, block_size=0), 1)
    assert callable(services.resolve("omnireduce-agg:3"))


def test_aggregator_memory_is_bounded_by_its_lanes(monkeypatch):
    """A channel's sums live in one message of at most ``lanes`` blocks, whatever the tensor size: the
    largest message on the wire is the same for a 10x larger tensor."""
    from sparsecomm.fabric.sim import sim

    sizes = []
    orig = sim.SimFabric.isend_each  # (every send of the SimFabric: isend() is isend_each() to one endpoint)

    def isend_each(self, tensor, dsts, tag, works, reliable=True, stable=False):
        sizes.extend([tensor.numel() * tensor.element_size()] * len(dsts))
        return orig(self, tensor, dsts, tag, works, reliable, stable)

    monkeypatch.setattr(sim.SimFabric, "isend_each", isend_each)

    def fn(ctx, numel):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=32, lanes=8, channels=2, deployment="dedicated")
        t.allreduce(torch.ones(numel))

    largest = []
    for numel in (32 * 64, 32 * 640):
        sizes.clear()
        sc.launch(functools.partial(fn, numel=numel), 2)
        largest.append(max(sizes))
    assert largest[0] == largest[1] == 8 * (32 * 4 + 4)


@pytest.mark.parametrize("density", [1.0, 0.3])
def test_a_dedicated_aggregators_message_buffers_do_not_grow_with_the_workers(monkeypatch, density):
    """An aggregator receives the workers' blocks through one ring per channel of a fixed number of its
    largest messages, summing each message as it comes in (the paper's ``lanes`` blocks per slot), so
    its message buffers (:meth:`sparsecomm.fabric.roles.Pool.nbytes`, kept for reuse across calls) are the same at
    n = 2, 4 and 8 and within that bound, but for each worker's 224-byte round-0 header (all of them are
    checked before anything is planned)."""
    from sparsecomm.fabric import roles
    from sparsecomm.transports.omnireduce import aggregator, service, window

    pools = []

    class _Pool(roles.Pool):
        def __init__(self):
            super().__init__()
            pools.append(self)

    monkeypatch.setattr(service, "Pool", _Pool)
    bs, lanes, channels, numel = 16, 16, 2, 16 * 1024   # >= 2 rounds in every channel at n = 8

    def fn(ctx):
        x = make_x(ctx.rank, numel, bs, density, 5)
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=bs, lanes=lanes, channels=channels,
                              deployment="dedicated")
        return all(torch.equal(t.allreduce(x), sum(make_x(r, numel, bs, density, 5) for r in range(ctx.world_size)))
                   for _ in range(2))

    full = wire.block_bytes(lanes, bs, 8)        # a channel's largest message (float64 blocks, look-aheads)
    ring = aggregator.WINDOW_MESSAGES * -(-full // window.ALIGN) * window.ALIGN
    firsts = aggregator.WINDOW_MESSAGES * -(-(4 * lanes * channels) // window.ALIGN) * window.ALIGN
    bound = channels * (ring + 2 * full) + firsts + 8 * wire.HDR   # + the sums, double-buffered; the verdict
    held = {}
    for n in (2, 4, 8):
        pools.clear()
        assert sc.launch(fn, n, network=NET) == [True] * n
        held[n] = max(p.nbytes() for p in pools) - n * 8 * wire.HDR   # (less the headers)
    assert max(held.values()) <= bound, (held, bound)
    assert density < 1 or held[2] == held[4] == held[8], held   # (dense: every round's messages are full)


def test_cached_results_are_reused_only_when_released_and_hold_no_stale_blocks():
    """Results come from a small cache of buffers: a buffer the caller still holds is never reused,
    and a reused one holds exactly the new sum (blocks non-zero last time, zero now, are cleared)."""
    def fn(ctx):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=64, lanes=16, result_cache=2)
        n, r = ctx.world_size, ctx.rank
        bad = []
        kept = t.allreduce(make_x(r, 70_000, 64, 0.3, 50))            # held: never reused
        kept_copy = kept.clone()
        for i in range(6):                                             # dropped each time
            d = (0.5, 0.05, 1.0, 0.0, 0.2, 0.7)[i]
            y = t.allreduce(make_x(r, 70_000, 64, d, 60 + i))
            if not torch.equal(y, sum(make_x(v, 70_000, 64, d, 60 + i) for v in range(n))):
                bad.append(i)
            view = y[:100]                                             # a view also pins the buffer
            del y
            z = t.allreduce(make_x(r, 70_000, 64, 0.3, 70 + i))
            if view.data_ptr() == z.data_ptr():
                bad.append(("reused a pinned buffer", i))
            del view, z
        if not torch.equal(kept, kept_copy):
            bad.append("held result changed")
        return bad
    assert sc.launch(fn, 3) == [[], [], []]


def test_disagreeing_shared_indices_or_scales_raise_on_every_worker():
    def fn(ctx):
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=8)
        errs = []
        a = _aligned(ctx.rank)
        if ctx.rank == 1:
            a.indices = a.indices.flip(0)           # another seed's coordinates
        q = _quantized(ctx.rank)
        if ctx.rank == 2:
            q.scale = q.scale * 2                   # a "shared" scale that is not shared
        for p in (a, q):
            try:
                t.allreduce(p)
                errs.append(None)
            except MismatchError as e:
                errs.append(str(e))
        return errs
    for errs in sc.launch(fn, 3):
        assert all(e is not None and "shared" in e for e in errs), errs


@pytest.mark.parametrize("deployment", ["colocated", "dedicated"])
def test_inplace_over_many_rounds(deployment):
    """In place, the hosted aggregator reads the worker's blocks straight from the input tensor while
    earlier rounds' sums are being written into it: every round's pending blocks are read first."""
    def fn(ctx):
        n = ctx.world_size
        t = sc.transports.get("omnireduce", ctx.fabric, block_size=16, lanes=4, channels=2,
                              deployment=deployment, inplace=True)
        x = make_x(ctx.rank, 5_000, 16, 0.6, 77)
        t.allreduce(x)
        return torch.equal(x, sum(make_x(v, 5_000, 16, 0.6, 77) for v in range(n)))
    assert sc.launch(fn, 3) == [True] * 3


def test_lazy_scan_by_ranges_and_runs_through_the_short_last_block():
    """A lazily scanned source, range by range, finds the blocks a whole scan finds (threshold too);
    gathering and writing a run that ends with the short last block move exactly its elements."""
    from sparsecomm.transports.omnireduce.blocks import BlockSink, DenseSource

    bs, numel = 16, 16 * 37 + 5
    x = make_x(0, numel, bs, 0.4, 5, torch.float32)
    x[3 * bs: 4 * bs] = 1e-3                         # a block under the threshold
    x[-2:] = 7.0                                      # the short last block is non-zero
    for thr in (0.0, 1e-2):
        whole = DenseSource(x, bs, thr)
        lazy = DenseSource(x, bs, thr, lazy=True)
        for lo, hi in ((20, 38), (0, 7), (7, 20)):
            lazy.scan(lo, hi)
        assert torch.equal(lazy.mask, whole.mask)
        assert bool(whole.mask[3]) == (thr == 0.0) and bool(whole.mask[-1])
    ids = np.arange(30, 38)                           # blocks 30..37, 37 being the 5-element tail
    out = torch.empty(len(ids), bs)
    DenseSource(x, bs).gather(ids, out)
    assert torch.equal(out[:-1].reshape(-1), x[30 * bs: 37 * bs])
    assert torch.equal(out[-1], torch.cat([x[37 * bs:], torch.zeros(bs - 5)]))
    y = torch.zeros(numel)
    sink = BlockSink(y, bs)
    sink.write(ids, out)
    assert torch.equal(y[30 * bs:], x[30 * bs:]) and not y[: 30 * bs].any()
    assert sink.written_ids().tolist() == ids.tolist()
    assert sink.written_ids() is sink.written_ids()      # remembered (the guard and the union's record read it)
    sink.mark(np.array([2, 3]))                           # until the next write or mark
    assert sink.written_ids().tolist() == [2, 3] + ids.tolist()
    sink.write(np.array([0]), out[:1])
    assert sink.written_ids().tolist() == [0, 2, 3] + ids.tolist()
    assert not sink.written_ids().flags.writeable
