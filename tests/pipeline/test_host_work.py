"""A method's and compressor's declared host work (:meth:`sparsecomm.methods.base.Method.work`,
:meth:`sparsecomm.compressors.base.Compressor.work`) and its charge to a modelled worker's clock by the pipeline
(:mod:`sparsecomm.pipeline.rounds`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import warnings

import pytest
import torch

import sparsecomm as sc
from sparsecomm import compressors, methods
from sparsecomm.compressors.topk import SAMPLE_CUTOFF, SAMPLE_SIZE, sample_rank
from sparsecomm.errors import InvalidValueError
from sparsecomm.fabric.sim.sim_host import CODEC_RATES, HOST_OPS, SUM_DTYPES, HostModel
from sparsecomm.pipeline import rounds
from sparsecomm.pipeline.core import CommPipeline
from sparsecomm.pipeline.step_size import StepSizeWarning

#: a rate per operation, each a different power of two (so the charge is exact in binary and no two ops alias)
RATES = {rate: 2.0 ** -(20 + 3 * i) for i, rate in enumerate(CODEC_RATES.values())}
#: a host with every transport cost too: the method's work is charged on top of them
BASE = HostModel(send_message_s=1e-5, recv_message_s=2e-5, send_byte_s=3e-10, recv_byte_s=4e-10,
                 sum_element_s={d: 1e-10 for d in SUM_DTYPES}, call_s={"ring": 1e-4, "allgather": 2e-4})
#: PowerSGD's bucket: an 8 x 6 matrix (rank 1 compresses it: 48 / (8 + 6) >= 2) and a bias of 6
SHAPES = (torch.Size([8, 6]), torch.Size([6]))


def _run(ctx, kind: str, steps: int) -> list[float]:
    """``steps`` rounds of a bucket on this worker (``kind``: ``powersgd``, ``powersgd-bias-first`` (the bias laid
    out before the matrix), ``eftopk`` per parameter, ``plain``); the clock after each."""
    if kind.startswith("powersgd"):
        pipe = CommPipeline(method="powersgd", transport="ring", fabric=ctx.fabric, matrix_approximation_rank=1)
        d, kw = 54, {"shapes": SHAPES[::-1] if kind == "powersgd-bias-first" else SHAPES}
    elif kind == "eftopk":
        pipe = CommPipeline("topk", "allgather", method="ef", fabric=ctx.fabric, ratio=0.01)
        d, kw = SAMPLE_CUTOFF + 1000 + 300, {"segments": (("w", SAMPLE_CUTOFF + 1000), ("b", 300))}
    else:
        pipe = CommPipeline(transport="ring", fabric=ctx.fabric)
        d, kw = 1000, {}
    out = []
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + ctx.rank)
        pipe.begin_step()
        pipe.start(torch.randn(d, generator=g), "b", **kw).wait()
        pipe.end_step()
        out.append(ctx.fabric.now())
    return out


def _times(kind: str, host: HostModel, steps: int = 2) -> list[list[float]]:
    return sc.launch(functools.partial(_run, kind=kind, steps=steps), 2,
                     network=sc.Network(bandwidth_gbps=10.0, latency_us=5.0, host=host))


def _recorded(monkeypatch, kind: str, steps: int = 2, ops=CODEC_RATES) -> list[list[tuple[int, str, int]]]:
    """Per step, the ``(rank, op, count)`` of every charge of ``ops`` (default: the codec's; the fabric's
    ``host_work``)."""
    from sparsecomm.fabric.sim.sim import SimFabric

    seen, real = [], SimFabric.host_work

    def record(self, op, count, dtype=None, *, transport=None):
        if op in ops:
            seen.append((self.rank, op, count, self.now()))
        return real(self, op, count, dtype, transport=transport)

    monkeypatch.setattr(SimFabric, "host_work", record)
    ends = _times(kind, dataclasses.replace(BASE, **RATES), steps)
    monkeypatch.undo()
    return [[(r, op, c) for r, op, c, t in seen if (s == 0 or t >= ends[r][s - 1]) and t < ends[r][s]]
            for s in range(steps)]


def _totals(charges, rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for r, op, c in charges:
        if r == rank:
            out[op] = out.get(op, 0) + c
    return out


def _seconds(counts: dict[str, int]) -> float:
    return math.fsum(c * RATES[CODEC_RATES[op]] for op, c in counts.items())


def test_powersgd_declares_its_products_and_passes_and_the_step_grows_by_count_times_rate(monkeypatch):
    """By hand, PowerSGD rank 1 on an 8 x 6 matrix and a bias of 6 (d = 54), a compressed step: encode adds the
    residual and checks it in one pass (54), copies the bias and P into the message (6 + 8), ``M Q`` (48
    multiply-adds), a QR and the call (2 kernels); the P round: the bias's sum and Q (6 + 6), ``M^T P`` (48), a QR and the call;
    the Q round's end: the call; decode: the bias's and Q's division and the residual (6 + 6 + 54), ``P Q^T``
    (48, ``matmul_outer``: the matrix written), a QR-free product call and the call (2). The modelled clock grows by exactly the counts times the
    rates on both workers (a symmetric step: every message shifts by the same charge)."""
    steps = _recorded(monkeypatch, "powersgd")
    want = {"elementwise": 68 + 12 + 66, "matmul": 48, "matmul_t": 48, "matmul_outer": 48, "kernel": 2 + 2 + 1 + 2}
    for rank in (0, 1):
        assert _totals(steps[1], rank) == want
    base = _times("powersgd", BASE)
    more = _times("powersgd", dataclasses.replace(BASE, **RATES))
    first = _totals(steps[0], 0)
    for rank in (0, 1):
        assert _totals(steps[0], rank) == first
        assert more[rank][0] - base[rank][0] == pytest.approx(_seconds(first), rel=1e-9, abs=0)
        assert more[rank][1] - base[rank][1] == pytest.approx(_seconds(first) + _seconds(want), rel=1e-9, abs=0)


def test_powersgd_declares_one_more_pass_for_a_matrix_written_through_its_aligned_buffer(monkeypatch):
    """The same bucket with its bias first: the 8 x 6 matrix starts 6 floats (24 bytes) in, off the 64-byte
    alignment of the products, so its residual lives in an aligned copy and its estimate is written into the aligned
    product buffer and then into the bucket. A compressed step declares exactly one more elementwise pass over the
    matrix (48) than the aligned layout's, and nothing else changes; the aligned layout's count is the test above's."""
    aligned = _recorded(monkeypatch, "powersgd")[1]
    shifted = _recorded(monkeypatch, "powersgd-bias-first")[1]
    for rank in (0, 1):
        want = _totals(aligned, rank)
        want["elementwise"] += 48
        assert _totals(shifted, rank) == want


def test_ef_topk_per_parameter_declares_the_selection_and_the_residual(monkeypatch):
    """EF + top-k 1% per parameter: EF checks what it compresses (``checks_input``: in the first round a read of
    each parameter's gradient, later in the pass that adds the residual), standing for the non-finite rule's read of
    the bucket and the top-k's own; a parameter above the top-k's sampling cutoff samples, collects its candidates
    (a pass of its own) and selects among them; one below it selects among all; each encode passes over its
    residual (copy, and from the second round the add) and scatters its k values out of it; each decode divides
    (one pass); the allgather that carries the concatenated payload declares its sum (the result zeroed and
    checked, both workers' values)."""
    steps = _recorded(monkeypatch, "eftopk", ops=(*CODEC_RATES, "check"))
    big, small = SAMPLE_CUTOFF + 1000, 300
    kb, ks = round(0.01 * big), 3
    cand = math.ceil(big * sample_rank(big, kb) / SAMPLE_SIZE)
    for s, adds in ((0, 1), (1, 2)):
        want = {"sample": SAMPLE_SIZE, "select": cand + small, "collect": big,
                **({"check": big + small} if s == 0 else {}),       # (EF's read of g; later folded into g + e)
                "elementwise": (kb + kb + adds * big + big) + (ks + ks + adds * small + small)
                + 2 * (big + small) + 2 * (kb + ks),        # (the allgather's sum: zeroed, checked, 2 workers' values)
                "kernel": 2 * (2 + 1)}
        for rank in (0, 1):
            assert _totals(steps[s], rank) == want
    base = _times("eftopk", BASE)
    more = _times("eftopk", dataclasses.replace(BASE, **RATES))
    for rank in (0, 1):
        codec = {op: c for op, c in _totals(steps[0], rank).items() if op in CODEC_RATES}
        assert more[rank][0] - base[rank][0] == pytest.approx(_seconds(codec), rel=1e-9, abs=0)


def test_ef_topk_step_grows_by_its_finiteness_reads_times_check_element_s():
    """The read that proves the EF + top-k step's input finite is charged at ``check_element_s``: EF's of each
    parameter's gradient in its first round (``big + small``; later folded into the pass that adds the residual),
    which stands for the non-finite rule's read of the bucket and the sampled top-k's of its input (those two
    are not made: ``checks_input``), on both workers."""
    big, small, rate = SAMPLE_CUTOFF + 1000, 300, 2.0 ** -30
    base = _times("eftopk", BASE)
    more = _times("eftopk", dataclasses.replace(BASE, check_element_s=rate))
    for rank in (0, 1):
        assert more[rank][0] - base[rank][0] == pytest.approx((big + small) * rate, rel=1e-9, abs=0)


def test_the_candidate_pass_without_its_rate_is_charged_as_the_elementwise_pass_it_was():
    """A host model without ``collect_element_s`` (``None``, a profile before it existed) charges the sampled
    top-k's candidate pass as the elementwise pass it was counted as (``elementwise_element_s`` times its
    ``codec_contention``): the EF + top-k step to the bit as with ``collect_element_s`` set to that charge; with a
    larger rate the step grows by the pass's elements times the difference."""
    big, ew = SAMPLE_CUTOFF + 1000, 2.0 ** -31
    rates = dataclasses.replace(BASE, elementwise_element_s=ew, codec_contention={"elementwise": 1.5})
    assert rates.collect_element_s is None
    old = _times("eftopk", rates)
    same = _times("eftopk", dataclasses.replace(rates, collect_element_s=1.5 * ew))
    assert [[t.hex() for t in r] for r in same] == [[t.hex() for t in r] for r in old]
    more = _times("eftopk", dataclasses.replace(rates, collect_element_s=4 * ew))
    for rank in (0, 1):
        assert more[rank][0] - old[rank][0] == pytest.approx(big * 2.5 * ew, rel=1e-9, abs=0)


def test_the_plain_round_charges_its_division():
    base = _times("plain", BASE, 1)
    more = _times("plain", dataclasses.replace(BASE, elementwise_element_s=1e-6), 1)
    for b, m in zip(base, more):
        assert m[0] - b[0] == pytest.approx(1000 * 1e-6, rel=1e-9, abs=0)


@pytest.mark.parametrize("kind", ["powersgd", "eftopk", "plain"])
def test_zero_codec_rates_leave_every_modelled_time_bit_identical(monkeypatch, kind):
    """A host model without the codec rates (0, the default) models the times it modelled before they
    existed: the same bits as with the pipeline's charge left out."""
    with_charge = _times(kind, BASE)
    monkeypatch.setattr(rounds, "charge", lambda fabric, work: None)
    without = _times(kind, BASE)
    assert [[t.hex() for t in r] for r in with_charge] == [[t.hex() for t in r] for r in without]
    # (and the charge is live: a rate lengthens the step)
    monkeypatch.undo()
    assert max(_times(kind, dataclasses.replace(BASE, elementwise_element_s=1e-6))[0]) > max(with_charge[0])


def test_a_fabric_that_charges_no_host_work_is_not_asked_for_work():
    """On a fabric that charges no host work (a real one; a SimFabric without a host model, modelled time and all)
    the strategies hold no fabric to charge and never ask ``work`` (nothing would be charged)."""
    class Refuses:
        def work(self, *a, **k):
            raise AssertionError("work asked on a fabric that charges no host work")

    real = types.SimpleNamespace(modelled_time=False, charges_host_work=False)
    unhosted = types.SimpleNamespace(modelled_time=True, charges_host_work=False)
    hosted = types.SimpleNamespace(modelled_time=True, charges_host_work=True)
    assert rounds.charging(real) is None and rounds.charging(unhosted) is None and rounds.charging(None) is None
    assert rounds.charging(hosted) is hosted
    for fabric in (real, unhosted):
        assert rounds.PlainRound(None, 2, fabric).fabric is None
        strategy = rounds.MethodRounds(Refuses(), None, None, None, None, 2, fabric)
        assert strategy.fabric is None
        assert strategy.charged("encode", None, 10, lambda: 7) == 7


#: what a step declares outside the transport's own protocol: the transport call's (Transport.run), the optimizer's
#: gather of a bucket, the non-finite rule's read and the method's codec work
STEP_OPS = ("sync", "call", "call_peer", "settle", "copy", "check", *CODEC_RATES)


def _diana_steps(ctx) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), method="diana", compressor="randk",
                                  ratio=0.25, transport="omnireduce")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("host", [None, HostModel()], ids=["no host model", "host model"])
def test_an_optimizer_step_declares_host_work_only_where_the_fabric_charges_it(monkeypatch, host):
    """A SimFabric without a host model charges nothing (``charges_host_work`` False): an optimizer step there
    neither calls ``host_work`` for the pipeline's and the transport call's work nor asks the method for its
    ``work``; with a host model it declares both on every worker (what is charged is unchanged)."""
    from sparsecomm.fabric.sim.sim import SimFabric
    from sparsecomm.methods.diana import Diana

    seen, real = [], SimFabric.host_work
    asked, real_work = [], Diana.work

    def record(self, op, count, dtype=None, *, transport=None):
        if op in STEP_OPS:
            seen.append((self.rank, op))
        return real(self, op, count, dtype, transport=transport)

    def work(self, phase, *a, **k):
        asked.append(phase)
        return real_work(self, phase, *a, **k)

    monkeypatch.setattr(SimFabric, "host_work", record)
    monkeypatch.setattr(Diana, "work", work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepSizeWarning)     # (the step size is not what is tested)
        sc.launch(_diana_steps, 2, network=sc.Network(host=host))
    if host is None:
        assert seen == [] and asked == []
    else:
        for rank in (0, 1):
            assert {op for r, op in seen if r == rank} >= {"sync", "call", "call_peer", "settle", "copy"}
        assert asked.count("encode") == asked.count("decode") == 4      # 2 workers x 2 steps


def test_declarations_by_hand():
    """The base compressor: one pass and a call; top-k below and above its cutoff and at k = d; the base
    method's encode (the compressor's work and a call; an exact round just the call) and decode (the division);
    an unknown phase names the phases."""
    assert compressors.get("identity").work(10) == {"elementwise": 10, "kernel": 1}
    assert compressors.get("identity").decompress_work(10) == {"elementwise": 10}
    tk = compressors.get("topk", ratio=0.01)
    assert tk.work(1000) == {"select": 1000, "elementwise": 10, "kernel": 1}
    d = 4 * SAMPLE_CUTOFF
    k = tk.size(d)
    assert tk.work(d) == {"check": d, "sample": SAMPLE_SIZE, "collect": d, "elementwise": k, "kernel": 1,
                          "select": math.ceil(d * sample_rank(d, k) / SAMPLE_SIZE)}
    assert k <= tk.work(d)["select"] < 2 * k
    assert tk.finite_work(d) == {op: n for op, n in tk.work(d).items() if op != "check"}     # (compress_finite's)
    assert compressors.get("topk", k=5).work(5) == {"elementwise": 10, "kernel": 1}
    assert tk.decompress_work(1000) == {"elementwise": 10}
    m = methods.get("none", compressor="fp16")
    st = m.init(10)
    assert m.work("encode", st, 10) == {"elementwise": 10, "kernel": 2}
    assert m.work("encode", st, 10, exact=True) == {"kernel": 1}
    assert m.work("decode", st, 10) == {"elementwise": 10, "kernel": 1}
    assert m.work("next_round", st, 10) == {}
    with pytest.raises(InvalidValueError, match="'encode', 'next_round' and 'decode'"):
        m.work("round", st, 10)
    # a warm-up round is the inner method's exact round
    w = methods.warmup(methods.get("ef", compressor="topk", ratio=0.1), 1)
    st = w.init(100)
    assert w.work("encode", st, 100) == {"check": 100, "elementwise": 200, "kernel": 1}    # (EF's read of g)
    st.rounds = 1
    assert w.work("encode", st, 100) == methods.get("ef", compressor="topk", ratio=0.1).work("encode", st, 100)
    assert set(CODEC_RATES) <= set(HOST_OPS)
