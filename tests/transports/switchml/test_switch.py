"""The ``switch`` transport (SwitchML-style in-network aggregation) on SimFabric: exactness, the
quantisation bound, loss recovery that never double-counts, bounded switch memory, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sparsecomm as sc
from sparsecomm import codec
from sparsecomm.errors import (FabricTimeout, IncompatibleError, InvalidValueError, MismatchError, NonFiniteError,
                               OverflowError_)
from sparsecomm.payload import Payload
from sparsecomm.transports.switchml import INT32_MAX, SwitchTransport
from sparsecomm.transports.switchml.dataplane import HEADER, Dataplane, SwitchConfig

LOSSES = (0.001, 0.01, 0.05)


def _data(rank: int, numel: int, job: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * job + rank)
    # mixed magnitudes across chunks so that the per-chunk exponents differ
    scale = torch.exp2(torch.randint(-6, 6, (numel // 64 + 1,), generator=g).float()).repeat_interleave(64)
    return torch.randn(numel, generator=g) * scale[:numel]


# ----------------------------------------------------------------------------- exactness and bound
@pytest.mark.parametrize("n", [1, 2, 3])
def test_lossless_integer_sum_and_quantisation_bound(n):
    numel = 1000   # not a multiple of 64: the last chunk is partial

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4, keep_fixed=True)
        x = _data(ctx.rank, numel)
        y = t.allreduce(x)
        return x, y, t.last_fixed

    out = sc.launch(fn, n)
    xs = torch.stack([o[0] for o in out]).double()
    fixed = out[0][2]
    for _, y, f in out:                         # every worker has the same bits
        assert torch.equal(y, out[0][1]) and torch.equal(f.sums, fixed.sums)
    # the agreed exponent of a chunk is the max over workers of the local ones
    local = torch.stack([codec.chunk_exponents(o[0], 64) for o in out]).clamp_min(-126)
    assert torch.equal(fixed.exponents, local.max(dim=0).values)
    # the switch's sums are exactly the sum of the workers' fixed-point codes
    codes = sum(codec.to_fixed(o[0], fixed.scales, chunk=64).to(torch.int64) for o in out)
    assert torch.equal(fixed.sums.to(torch.int64), codes)
    assert codes.abs().max() <= INT32_MAX
    # float result within n * 0.5 / scale of the exact sum (plus float32 rounding of the output)
    scale = fixed.scales.repeat_interleave(64)[:numel]
    exact = xs.sum(0)
    err = (out[0][1].double() - exact).abs()
    bound = n * 0.5 / scale + exact.abs() * 2.0**-24 + 1e-300
    assert (err <= bound).all(), float((err / bound).max())
    # and the bound is not vacuous: it is tight to within a few orders of magnitude of the data
    assert float((n * 0.5 / scale / (exact.abs() + 1)).max()) < 1e-6


def test_bypass_int_tensor_and_quantized_payload_sum_exactly():
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=3)
        r = ctx.rank
        ints = torch.arange(300, dtype=torch.int64) * (r + 1) - 1000 * r
        codes = torch.randint(-100, 100, (200,), generator=torch.Generator().manual_seed(r), dtype=torch.int32)
        scale = torch.tensor([0.5, 0.25, 2.0, 1.0])
        p = Payload("quantized", values=codes, shape=(200,), dtype=torch.float32, scale=scale,
                    bucket_size=64, shared_scale=True)
        return ints, t.allreduce(ints), p, t.allreduce(p)

    out = sc.launch(fn, 3)
    want_int = sum(o[0] for o in out)
    want_q = sum(o[2].to_dense().double() for o in out)
    for o in out:
        assert o[1].dtype == torch.int64 and torch.equal(o[1], want_int)
        assert torch.allclose(o[3].double(), want_q, rtol=0, atol=1e-6)


def test_aligned_payload_sums_values_at_shared_indices():
    idx = torch.tensor([3, 17, 40, 99, 5])

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric)
        v = torch.tensor([1.0, -2.0, 3.5, 0.25, 8.0]) * (ctx.rank + 1)
        return t.allreduce(Payload("aligned", values=v, indices=idx, shape=(100,), dtype=torch.float32))

    out = sc.launch(fn, 2)
    want = torch.zeros(100)
    want[idx] = torch.tensor([1.0, -2.0, 3.5, 0.25, 8.0]) * 3
    for y in out:
        assert torch.allclose(y, want, atol=1e-6)


def test_stochastic_rounding_is_deterministic_and_within_one_step():
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4, rounding="stochastic", seed=7,
                              keep_fixed=True)
        x = _data(ctx.rank, 700)
        return x, t.allreduce(x), t.last_fixed

    a, b = sc.launch(fn, 2), sc.launch(fn, 2)
    assert torch.equal(a[0][1], b[0][1])
    exact = a[0][0].double() + a[1][0].double()
    scale = a[0][2].scales.repeat_interleave(64)[:700]
    assert ((a[0][1].double() - exact).abs() <= 2 * 1.0 / scale + exact.abs() * 2.0**-24).all()


# ----------------------------------------------------------------------------- loss recovery
def _lossy_run(n: int, loss: float, numel: int, pool: int, jobs: int = 1):
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=pool, audit=True, keep_fixed=True)
        res = []
        for j in range(jobs):
            y = t.allreduce(_data(ctx.rank, numel, j))
            res.append((y, t.last_fixed.sums.clone(), t.last_info))
        return res, t.dataplane

    return sc.launch(fn, n, network=sc.Network(loss=loss, seed=11))


def _check_counts(dp: Dataplane, n: int, packets_per_job: list[int]) -> None:
    """Every contribution (control and data packets of every job, every worker) counted exactly once."""
    want = {}
    for j, P in enumerate(packets_per_job, start=1):
        for w in range(n):
            want[(j, -1, w)] = 1
            for p in range(P):
                want[(j, p, w)] = 1
    assert dict(dp.audit) == want
    assert dp.stats["overflow"] == 0


@pytest.mark.parametrize("n", [2, 3, 8, 32])
def test_loss_gives_bit_identical_result_and_never_double_counts(n):
    numel, pool = (1536, 8) if n == 32 else (2048, 8)
    M = math.ceil(numel / 64)
    P = M + min(pool, M)
    base = _lossy_run(n, 0.0, numel, pool)
    ref = base[0][0][0]
    _check_counts(base[0][1], n, [P])
    for loss in LOSSES:
        out = _lossy_run(n, loss, numel, pool)
        retx = sum(o[0][0][2]["data"]["retransmissions"] + o[0][0][2]["control"]["retransmissions"]
                   for o in out)
        for o in out:
            assert torch.equal(o[0][0][1], ref[1]), f"n={n} loss={loss}: integer sums differ"
            assert torch.equal(o[0][0][0], ref[0])
        dp = out[0][1]
        _check_counts(dp, n, [P])
        if loss >= 0.01:      # the faults really happened (the test can fail)
            assert retx > 0 and dp.stats["dropped"] + dp.stats["retransmit"] > 0


def test_consecutive_jobs_of_various_sizes_under_loss():
    sizes = [64 * 8, 10, 0, 64 * 3 + 5, 64 * 21]

    def fn(ctx):
        ts = [sc.transports.get("switch", ctx.fabric, pool_size=p, audit=True) for p in (8, 5)]
        out = []
        for j, numel in enumerate(sizes):
            t = ts[j % 2]
            x = _data(ctx.rank, numel, j)
            out.append((x, t.allreduce(x)))
        return out, ts[0].dataplane

    ref = sc.launch(fn, 3)
    lossy = sc.launch(fn, 3, network=sc.Network(loss=0.05, seed=3))
    for j, numel in enumerate(sizes):
        exact = sum(o[0][j][0].double() for o in ref)
        for o, l in zip(ref, lossy):
            assert o[0][j][1].shape == (numel,)
            assert torch.equal(o[0][j][1], l[0][j][1])
            if numel:
                assert (o[0][j][1].double() - exact).abs().max() < 1e-4 * (exact.abs().max() + 1)
    dp = lossy[0][1]
    assert max(dp.audit.values()) == 1 and dp.stats["overflow"] == 0
    assert ref[0][1] is not lossy[0][1]


def test_switch_memory_is_the_fixed_pool():
    cfg = SwitchConfig(elems=64, slots=9, burst=1)

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=6, switch_slots=9)
        before = dict(t.dataplane.register_shapes)
        for j in range(3):
            t.allreduce(_data(ctx.rank, 64 * 40, j))
        return before, t.dataplane

    out = sc.launch(fn, 4, network=sc.Network(loss=0.01, seed=5))
    before, dp = out[0]
    assert before == dp.register_shapes == {
        "values": (9, 2, 64), "seen": (9, 2), "count": (9, 2), "exponent": (9, 2)}
    # the SimFabric runs the paper's program: 64-value packets, one per message (transports/defaults.py)
    assert dp.config == SwitchConfig(elems=64, slots=9, burst=1, audit=False) == cfg
    # slot 0 (control) and slots 1..6 (the pool) were used; slots 7, 8 never touched
    assert dp.values[1:7].any() and not dp.values[7:].any() and not dp.seen[7:].any()
    assert dp.stats["packets"] >= 4 * 3 * (40 + 6 + 1)


def test_dataplane_program_semantics():
    dp = Dataplane(SwitchConfig(elems=64, slots=4))
    width = HEADER + 64

    def pkt(slot, v, w, n=2, e=0, val=1):
        r = np.zeros((1, width), dtype=np.int32)
        r[0, :HEADER] = [1, slot, v, w, 0, 1, n, e]
        r[0, HEADER:] = val
        return r

    assert [len(r) for r in dp.process(pkt(1, 0, 0, val=5, e=3))] == [0, 0]   # first writer: stored
    assert [len(r) for r in dp.process(pkt(1, 0, 0, val=5))] == [0, 0]        # duplicate, incomplete: drop
    mc, uc = dp.process(pkt(1, 0, 1, val=7, e=-2))                       # last: multicast the sum
    assert len(mc) == 1 and len(uc) == 0 and (mc[0][HEADER:] == 12).all() and mc[0][7] == 3
    mc, uc = dp.process(pkt(1, 0, 0, val=5))                             # duplicate, complete: unicast
    assert len(mc) == 0 and len(uc) == 1 and (uc[0][HEADER:] == 12).all()
    dp.process(pkt(1, 1, 0, val=1))                                      # next use, other set
    assert dp.seen[1, 0] == 0b10 and dp.seen[1, 1] == 0b01               # worker 0 left set 0
    mc, _ = dp.process(pkt(1, 1, 1, val=2))
    assert (mc[0][HEADER:] == 3).all()
    assert dp.stats["consumed"] == 4 and dp.stats["dropped"] == 1 and dp.stats["retransmit"] == 1


def test_timeout_doubles_after_threshold_and_crash_gives_up():
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4, timeout=1e-3, timeout_threshold=3,
                              timeout_increment=3)
        t.allreduce(_data(ctx.rank, 64 * 30))
        return t.last_info["data"]["final_timeout"]

    out = sc.launch(fn, 4, network=sc.Network(loss=0.1, seed=2))
    assert max(out) >= 2e-3

    def crash(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4, give_up_s=0.05)
        return t.allreduce(_data(ctx.rank, 64 * 30))

    with pytest.raises(FabricTimeout, match="unanswered"):
        sc.launch(crash, 3, network=sc.Network(crash={1: 5}))


def test_modelled_time_is_deterministic():
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=16)
        t.allreduce(_data(ctx.rank, 64 * 64))
        return t.last_stats.modelled_time_s

    a, b = sc.launch(fn, 4), sc.launch(fn, 4)
    assert a == b and len(set(a)) == 1


# ----------------------------------------------------------------------------- bad input
def _errors(fn, n, **kw):
    """Run ``fn`` on every worker, catching the error; return (type name, message) per worker."""
    def wrapped(ctx):
        try:
            fn(ctx)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e)
        return None

    return sc.launch(wrapped, n, **kw)


@pytest.mark.parametrize("case, err", [
    ("nan", NonFiniteError), ("inf", NonFiniteError), ("huge", OverflowError_), ("numel", MismatchError),
    ("dtype", MismatchError), ("int_overflow", OverflowError_), ("int64_range", OverflowError_),
])
def test_bad_input_raises_the_same_clear_error_on_every_worker_and_recovers(case, err):
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4)
        x = _data(ctx.rank, 640)
        bad = ctx.rank == 1
        if case == "nan" and bad:
            x[600] = float("nan")
        elif case == "inf" and bad:
            x[3] = float("-inf")
        elif case == "huge" and bad:
            x[100] = 2.0**127
        elif case == "numel" and bad:
            x = x[:-1]
        elif case == "dtype" and bad:
            x = x.double()
        elif case == "int_overflow":
            x = torch.full((100,), 2**30, dtype=torch.int32)
        elif case == "int64_range" and bad:
            x = torch.full((640,), 2**40, dtype=torch.int64)
        elif case == "int64_range":
            x = torch.ones(640, dtype=torch.int64)
        try:
            t.allreduce(x)
        except err as e:
            msg = (type(e).__name__, str(e))
        else:
            return None
        # the transport (and the switch) stay usable after the error
        y = t.allreduce(torch.ones(100) * (ctx.rank + 1))
        assert torch.allclose(y, torch.full((100,), 6.0))
        return msg

    out = sc.launch(fn, 3, network=sc.Network(loss=0.02, seed=1))
    assert all(o is not None for o in out), out
    assert len({o for o in out}) == 1       # the same error on every worker
    assert "switch allreduce" in out[0][1]


def test_more_workers_than_the_programs_bitmap_holds_is_refused_on_every_worker():
    out = _errors(lambda ctx: sc.transports.get("switch", ctx.fabric, switch_workers=32), 33)
    assert all(o is not None and o[0] == "IncompatibleError" and "at most 32" in o[1] for o in out)
    for bad in (16, 48, 2048, True):
        with pytest.raises(InvalidValueError, match="multiple of 32"):
            SwitchConfig(workers=bad)
    # by default the program holds the job: the reference program's one word up to 32 workers
    from types import SimpleNamespace

    def width(n):
        return SwitchConfig().on(SimpleNamespace(message_bytes=None, world_size=n)).workers

    assert [width(n) for n in (1, 32, 33, 64, 65, 1024, 5000)] == [None, None, 64, 64, 96, 1024, 1024]


def test_64_workers_sum_exactly_through_a_two_word_bitmap_under_loss():
    """Past SwitchML's 32-worker bitmap: 64 workers (a program compiled for them by default, two 32-bit
    words per slot and set) sum integers exactly, and floats within the quantisation bound, with lost
    packets and results recovered (a contribution counted once, whichever word holds its bit)."""
    n, numel = 64, 64 * 6 + 5

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=3, audit=True, keep_fixed=True)
        xi = (torch.arange(numel, dtype=torch.int32) - 100) * (ctx.rank + 1)
        yi = t.allreduce(xi)
        yf = t.allreduce(_data(ctx.rank, numel, 0))
        return yi, yf, t.dataplane, t.config, t.last_fixed.scales

    out = sc.launch(fn, n, network=sc.Network(loss=0.01, seed=9))
    want_i = (torch.arange(numel, dtype=torch.int32) - 100) * (n * (n + 1) // 2)
    exact = sum(_data(r, numel, 0).double() for r in range(n))
    dp, cfg, scales = out[0][2], out[0][3], out[0][4]
    assert cfg.workers == 64 and dp.seen.shape == (cfg.slots, 2, 2)
    bound = n * 0.5 / scales.repeat_interleave(64)[:numel] + exact.abs() * 2.0**-24
    for yi, yf, _, _, _ in out:
        assert torch.equal(yi, want_i) and torch.equal(yf, out[0][1])
        assert ((yf.double() - exact).abs() <= bound).all()
    # every contribution of workers 32..63 (the second word) was counted exactly once
    assert dp.audit and set(dp.audit.values()) == {1}
    assert {w for (_, _, w) in dp.audit} == set(range(n))
    assert dp.stats["dropped"] + dp.stats["retransmit"] > 0         # losses happened and were recovered


def test_invalid_arguments_and_per_worker_scales():
    def fn(ctx):
        with pytest.raises(ValueError, match="slot_elems"):
            SwitchTransport(ctx.fabric, slot_elems=100)
        with pytest.raises(ValueError, match="pool_size"):
            SwitchTransport(ctx.fabric, pool_size=8192)
        t = SwitchTransport(ctx.fabric)
        p = Payload("quantized", values=torch.zeros(4, dtype=torch.int32), shape=(4,), dtype=torch.float32,
                    scale=torch.tensor([0.1 * (ctx.rank + 1)]), shared_scale=False)
        with pytest.raises(IncompatibleError, match="switch"):
            t.allreduce(p)
        with pytest.raises(IncompatibleError):
            t.allreduce(torch.zeros(3, dtype=torch.bool))
        # a scale that differs across workers although declared shared: caught by the control round
        p.shared_scale = True
        with pytest.raises(MismatchError, match="fingerprint"):
            t.allreduce(p)
        return True

    assert sc.launch(fn, 2) == [True, True]


def test_service_spec_round_trip():
    for cfg in (SwitchConfig(), SwitchConfig(elems=256), SwitchConfig(slots=64, burst=4, audit=True)):
        spec = cfg.spec()
        name, _, arg = spec.partition(":")
        assert name == "switch" and SwitchConfig.parse(arg or None) == cfg
    assert SwitchConfig.parse("256") == SwitchConfig(elems=256)
    with pytest.raises(ValueError, match="unknown switch option"):
        SwitchConfig.parse("foo=1")
    from sparsecomm.fabric import services

    assert callable(services.resolve("switch:elems=256"))


class _Reference:
    """The switch program of the dataplane's docstring, packet by packet in plain Python (the model the
    compiled program must equal): registers, replies, counters."""

    def __init__(self, cfg: SwitchConfig, world: int) -> None:
        self.values = np.zeros((cfg.slots, 2, cfg.elems), dtype=np.int64)
        self.seen = np.zeros((cfg.slots, 2), dtype=object)      # Python ints: a bitmap of any width
        self.count = np.zeros((cfg.slots, 2), dtype=np.int64)
        self.exponent = np.zeros((cfg.slots, 2), dtype=np.int64)
        self.world, self.slots, self.width, self.stats = world, cfg.slots, cfg.width, {}

    def _bump(self, key):
        self.stats[key] = self.stats.get(key, 0) + 1

    def process(self, rows):
        mc, uc = [], []
        for row in rows.tolist():
            if row[0] == 0:                                 # an unused row of a burst
                continue
            self._bump("packets")
            slot, v, w, n, e = row[1], row[2], row[3], row[6], row[7]
            if not (row[0] == 1 and 0 <= slot < self.slots and v in (0, 1) and 0 <= w < n <= self.width
                    and n == self.world):
                self._bump("malformed")
                continue
            before = int(self.seen[slot, v])
            self.seen[slot, v] = before | (1 << w)
            self.seen[slot, 1 - v] &= ~(1 << w)
            e = (e + 128) % 256 - 128                       # the int8 register
            if not before & (1 << w):
                vec = np.array(row[HEADER:], dtype=np.int64)
                if before == 0:
                    self.values[slot, v], self.exponent[slot, v], self.count[slot, v] = vec, e, n - 1
                else:
                    total = self.values[slot, v] + vec
                    if (total > INT32_MAX).any() or (total < -INT32_MAX - 1).any():
                        self._bump("overflow")
                    self.values[slot, v] = (total + 2**31) % 2**32 - 2**31     # int32 wrap-around
                    self.exponent[slot, v] = max(self.exponent[slot, v], e)
                    self.count[slot, v] -= 1
                self._bump("consumed")
                if self.count[slot, v] == 0:
                    self._bump("multicast")
                    mc.append([2] + row[1:7] + [int(self.exponent[slot, v])] + self.values[slot, v].tolist())
            elif self.count[slot, v] == 0:
                self._bump("retransmit")
                uc.append([3] + row[1:7] + [int(self.exponent[slot, v])] + self.values[slot, v].tolist())
            else:
                self._bump("dropped")
        return mc, uc


def random_rows(rng, step: int, k: int, width: int, big: bool = True, world: int = 3) -> np.ndarray:
    """A random burst of ``k`` switch rows of a ``world``-worker job: distinct and repeated slots,
    duplicates, forged worker counts, empty rows; values over the whole int32 range if ``big``
    (wrap-around sums), else small."""
    rows = np.zeros((k, width), dtype=np.int32)
    rows[:, 0] = rng.choice([0, 1, 1, 1, 2], size=k)
    rows[:, 1], rows[:, 2] = rng.integers(-1, 7, size=k), rng.integers(0, 3, size=k)
    rows[:, 3], rows[:, 4], rows[:, 5] = rng.integers(0, world, size=k), step, 1
    rows[:, 6] = rng.choice([world, world, world, 32], size=k)
    rows[:, 7] = rng.integers(-300, 300, size=k)
    rows[:, HEADER:] = rng.integers(-2**31 if big else -1000, 2**31 - 1 if big else 1000, size=(k, width - HEADER))
    return rows


def round_rows(rng, step: int, world: int, width: int) -> np.ndarray:
    """One round of a ``world``-worker job on slots 1..3 (set ``step % 2``): every worker's packet once, in a
    random order, with repeats of a quarter of them (before and after the slot completes) and two packets
    claiming 32 workers; values over the whole int32 range every fourth round (wrap-around sums)."""
    big = step % 4 == 0
    rows = []
    for slot in (1, 2, 3):
        seq = list(rng.permutation(world)) + list(rng.choice(world, size=max(1, world // 4)))
        seq = seq[:world // 2] + list(rng.permutation(seq[world // 2:]))     # repeats before and after
        for w in seq:
            rows.append([1, slot, step % 2, w, step, 1, world, int(rng.integers(-300, 300))])
        rows.append([1, slot, step % 2, 0, step, 1, 32, 0])                 # forged worker count
    out = np.zeros((len(rows), width), dtype=np.int32)
    out[:, :HEADER] = rows
    out[:, HEADER:] = rng.integers(-2**31 if big else -1000, 2**31 - 1 if big else 1000,
                                   size=(len(rows), width - HEADER))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 40, 70])
def test_compiled_program_equals_the_reference_packet_by_packet(world):
    """Random bursts -- distinct and repeated slots, duplicates, forged worker counts, wrap-around sums,
    exponents beyond int8 -- give the same replies, registers and counters as the plain-Python model; past
    32 workers with a bitmap of 3 words (the model's bitmap is one integer of any width)."""
    rng = np.random.default_rng(world)
    cfg = SwitchConfig(elems=64, slots=6, audit=True, workers=None if world <= 32 else 96)
    dp, ref = Dataplane(cfg), _Reference(cfg, world=world)
    dp.world = world
    width = HEADER + 64
    if world <= 32:
        bursts = [random_rows(rng, step, int(rng.integers(1, 6)), width, big=step % 7 == 0, world=world)
                  for step in range(300)]
    else:      # random rows would hardly ever complete a slot of so many workers: whole rounds, in bursts
        rows = np.concatenate([round_rows(rng, step, world, width) for step in range(12)])
        cuts = np.cumsum(rng.integers(1, 6, size=len(rows)))
        bursts = np.split(rows, cuts[cuts < len(rows)])
    for rows in bursts:
        got = dp.process(rows)
        want = ref.process(rows)
        for x, y in zip(got, want):
            assert x.shape == (len(y), width) and x.tolist() == y
    assert np.array_equal(dp.values, ref.values) and np.array_equal(dp.exponent, ref.exponent)
    words = dp.seen.reshape(cfg.slots, 2, -1).astype(object)
    seen = sum(words[:, :, q] << (32 * q) for q in range(words.shape[2]))
    assert np.array_equal(seen, ref.seen) and np.array_equal(dp.count, ref.count)
    assert dict(dp.stats) == ref.stats and ref.stats["multicast"] > 10
    assert ref.stats["malformed"] > 10 and ref.stats["retransmit"] > 10
    # one worker completes a slot with its first packet: no adds, no duplicates before completion
    assert world == 1 or (ref.stats["dropped"] > 10 and ref.stats["overflow"] > 0)
    assert sum(dp.audit.values()) == ref.stats["consumed"]


def test_in_place_gives_the_same_bits_into_the_input():
    def fn(ctx):
        x = _data(ctx.rank, 64 * 9 + 5)
        ref = sc.transports.get("switch", ctx.fabric, pool_size=4).allreduce(x.clone())
        y = x.clone()
        out = sc.transports.get("switch", ctx.fabric, pool_size=4, inplace=True).allreduce(y)
        return ref, out, y

    for ref, out, y in sc.launch(fn, 3):
        assert torch.equal(ref, out) and torch.equal(y, ref) and out.data_ptr() == y.data_ptr()


def test_fixed_result_only_when_asked_and_the_same_bits_either_way():
    """``keep_fixed=False`` (the default) keeps no int32 sums (``last_fixed`` is ``None``, also after a
    job that kept them); the float result is bit-identical to a job that keeps them, in place or not,
    and the kept sums divided by the scales give exactly that result."""
    def fn(ctx):
        x = _data(ctx.rank, 64 * 11 + 3)
        kept = sc.transports.get("switch", ctx.fabric, pool_size=4, keep_fixed=True)
        plain = sc.transports.get("switch", ctx.fabric, pool_size=4)
        a = kept.allreduce(x.clone())
        fixed = kept.last_fixed
        b = plain.allreduce(x.clone())
        y = x.clone()
        c = sc.transports.get("switch", ctx.fabric, pool_size=4, inplace=True).allreduce(y)
        kept.keep_fixed = False
        d = kept.allreduce(x.clone())
        return a, b, c, d, fixed, plain.last_fixed, kept.last_fixed

    for a, b, c, d, fixed, none1, none2 in sc.launch(fn, 3):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
        assert fixed is not None and none1 is None and none2 is None
        scale = fixed.scales.repeat_interleave(64)[:a.numel()]
        assert torch.equal((fixed.sums.double() / scale).float(), a)


def test_a_worker_takes_each_outstanding_result_once_and_refuses_a_forged_exponent():
    from sparsecomm.errors import ProtocolError
    from sparsecomm.transports.switchml.jobs import FloatJob
    from sparsecomm.transports.switchml.dataplane import F_EXP, F_JOB, F_PKT, F_TYPE, T_EMPTY, T_RESULT
    from sparsecomm.transports.switchml.lanes import _accept

    L, P = 4, 5
    lane_pkt, lane_slots, parity = np.arange(L), np.arange(1, L + 1), np.zeros(8, dtype=np.int32)
    rows = np.zeros((6, HEADER + 64), dtype=np.int32)
    rows[:, F_TYPE], rows[:, F_JOB], rows[:, F_PKT] = T_RESULT, 7, [2, 2, 0, 5, 1, 3]
    rows[4, F_JOB], rows[5, F_TYPE] = 6, T_EMPTY     # a second copy of 2, 5 not outstanding, another job's
    at, pks, lanes = (np.empty(6, dtype=np.int64) for _ in range(3))
    deadline = np.full(L, 1.0)
    got, ignored, nxt, rej = _accept(rows, lane_pkt, lane_slots, parity, 7, 0, P, at, pks, lanes, deadline)
    assert (got, ignored, nxt, rej) == (2, 3, 1, -1)
    assert deadline.tolist() == [1.0, 1.0, np.inf, 1.0]       # the lane done: no deadline of its own left
    assert at[:2].tolist() == [0, 2] and pks[:2].tolist() == [2, 0] and lanes[:1].tolist() == [0]
    assert lane_pkt.tolist() == [4, 1, -1, 3] and parity.tolist() == [0, 1, 0, 1, 0, 0, 0, 0]

    x = torch.ones(3 * 64)
    job = FloatJob(x, x, torch.zeros(3 * 64, dtype=torch.int32), np.zeros(3, dtype=np.int64), 64, 2, 2, None)
    res = np.zeros((1, HEADER + 64), dtype=np.int32)
    res[0, F_EXP] = 200                              # no int8 exponent register holds it
    with pytest.raises(ProtocolError, match="exponent"):
        job.consume(np.array([0]), res)
