"""What theory says about the step size (sparsecomm.pipeline.step_size, theory.rates.step_scale): the method's
variance factor and the scale on a learning rate tuned without compression, read at construction, and
the one-line warning for the methods whose step bound carries the variance factor."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import sparsecomm as sc
from sparsecomm.pipeline.step_size import StepSizeWarning
from theory import rates


def test_step_scale_is_the_theorems_step_times_L():
    assert rates.step_scale("diana", omega=3.0, n=1) == pytest.approx(1 / 19)
    assert rates.step_scale("diana", omega=3.0, n=2) == pytest.approx(1 / 10)
    assert rates.step_scale("diana", omega=3.0, n=2) == pytest.approx(rates.diana(7.0, 3.0, 2)[0] * 7.0)
    assert rates.step_scale("dcgd", omega=3.0, n=2) == pytest.approx(rates.dcgd(5.0, 3.0, 2) * 5.0) == 0.25
    assert rates.step_scale("ef21", delta=1.0) == 1.0                   # no compression: GD's 1/L
    assert rates.step_scale("ef21", delta=0.25) == pytest.approx(rates.ef21(2.0, 2.0, 0.25) * 2.0)
    assert rates.step_scale("ef", delta=0.25) is None


def _build(ctx, lr=0.05, **kw):
    with ctx.seeded(0):
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), **kw).step_size_hint


def _run(**kw):
    """(rank 0's hint, rank 1's hint, the StepSizeWarnings given; sim workers are threads, so the
    warnings are recorded around the launch)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h0, h1 = sc.launch(functools.partial(_build, **kw), world_size=2, backend="sim")
    return h0, h1, [str(w.message) for w in caught if issubclass(w.category, StepSizeWarning)]


def test_diana_randk_reports_omega_and_warns_once_naming_the_learning_rate():
    """DIANA + shared-seed rand-k at ratio 0.25 on 2 workers (the issue's setting: lr 0.05, momentum 0.9
    stayed at chance accuracy): omega = d/k - 1 = 3, one average of errors (shared coordinates), so
    theory's step is 1/(1 + 6*3) of the uncompressed one; rank 0 warns once, naming lr and the bound."""
    h0, h1, w = _run(compressor="diana", ratio=0.25)
    assert h0 == h1 and h0.method == "diana" and h0.variance == "omega" and h0.n_eff == 1
    assert h0.factor == pytest.approx(3.0, abs=0.02) and h0.scale == pytest.approx(1 / (1 + 6 * h0.factor))
    assert h0.lr(0.05) == pytest.approx(0.05 * h0.scale)
    assert len(w) == 1                                   # rank 0 only
    assert "omega = 3" in w[0] and "lr=0.05" in w[0] and f"use lr <= {0.05 * h0.scale:.3g}" in w[0]


def test_independent_coordinates_average_their_errors():
    h, _, _ = _run(compressor="randk", method="diana", ratio=0.25, independent=True, transport="allgather")
    assert h.n_eff == 2 and h.scale == pytest.approx(1 / (1 + 6 * h.factor / 2))


@pytest.mark.parametrize("kw,variance,scale", [
    (dict(compressor="topk", method="ef", ratio=0.25), "delta", None),          # no bound of this form
    (dict(compressor="topk", method="ef21", ratio=0.25), "delta", "theory"),    # conservative: no warning
    (dict(compressor="none"), "omega", 1.0),                                    # plain averaging
    (dict(compressor="powersgd"), None, None),
])
def test_no_warning_where_theory_has_no_variance_scaled_bound(kw, variance, scale):
    h, _, w = _run(**kw)
    assert not w and h.variance == variance and not h.warns
    if scale == "theory":
        assert h.scale == pytest.approx(rates.step_scale("ef21", delta=h.factor)) and h.scale < 0.25
    else:
        assert h.scale == scale


def test_iid_rule_is_one_over_one_plus_omega_over_n_and_the_default_is_the_worst_case():
    """The i.i.d.-data rule 1/(1 + omega/n) next to the theorems' worst case (DIANA 1/(1 + 6 omega/n),
    DCGD 1/(1 + 2 omega/n)); ``lr(base)`` uses the worst case unless told ``rule="iid"``."""
    assert rates.step_scale("diana", omega=3.0, n=2, rule="iid") == pytest.approx(1 / 2.5)
    assert rates.step_scale("dcgd", omega=3.0, n=2, rule="iid") == pytest.approx(1 / 2.5)
    assert rates.step_scale("ef21", delta=0.25, rule="iid") == rates.step_scale("ef21", delta=0.25)
    with pytest.raises(sc.errors.InvalidValueError, match="worst-case"):
        rates.step_scale("diana", omega=3.0, n=2, rule="practical")
    h, _, _ = _run(compressor="diana", ratio=0.25)
    assert h.iid_scale == pytest.approx(1 / (1 + h.factor))
    assert h.iid_scale == pytest.approx(h.scale * (1 + 6 * h.factor) / (1 + h.factor))     # 4.75x the worst case
    assert h.lr(0.05) == pytest.approx(0.05 * h.scale) and h.lr(0.05, rule="iid") == pytest.approx(0.05 * h.iid_scale)
    with pytest.raises(sc.errors.InvalidValueError, match="rule"):
        h.lr(0.05, rule="fast")


def _build_groups(ctx):
    """The recsys task's layout: the user's lr 0.5 on the dense layers, 40x that on the embeddings."""
    with ctx.seeded(0):
        emb, dense = nn.Embedding(512, 64), nn.Linear(64, 1)
    inner = torch.optim.SGD([{"params": emb.parameters(), "lr": 20.0}, {"params": dense.parameters()}], lr=0.5)
    return sc.DistributedOptimizer(inner, compressor="qsgd", transport="allgather").step_size_hint


def test_the_warning_quotes_the_users_lr_not_a_parameter_groups():
    """The optimizer's own lr (``defaults["lr"]``, what the user set), the value allowed by each rule, and the
    other groups named to scale alike; never "if lr=20" (the embedding group's internal rate)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h, _ = sc.launch(_build_groups, world_size=2, backend="sim")
    w = [str(x.message) for x in caught if issubclass(x.category, StepSizeWarning)]
    assert len(w) == 1 and h.method == "none" and h.warns
    assert f"if lr=0.5 suits uncompressed training, use lr <= {h.lr(0.5):.3g} (opt.step_size_hint.lr(0.5))" in w[0]
    assert f"or lr <= {h.lr(0.5, 'iid'):.3g} by the i.i.d.-data rule" in w[0]
    assert "parameter groups at lr=20 scale by the same factor" in w[0] and "if lr=20" not in w[0]


def _diverged(ctx, transport_kwargs):
    with ctx.seeded(0):
        model = nn.Linear(32, 4)
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="qsgd",
                                  transport="allgather", transport_kwargs=transport_kwargs)
    model(torch.ones(2, 32)).sum().backward()
    if ctx.rank == 0:
        model.weight.grad[0, 0] = float("nan")
    try:
        opt.step()
    except sc.errors.NonFiniteError as e:
        return str(e)
    return None


@pytest.mark.parametrize("transport_kwargs", [None, {"nonfinite": "pass"}], ids=["transport", "pipeline"])
def test_a_divergence_advises_a_smaller_learning_rate_before_letting_nan_through(transport_kwargs):
    """The transport's check and the pipeline's: the same advice on every worker, the learning rate
    (``opt.step_size_hint``) first, ``nonfinite='pass'`` last."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepSizeWarning)
        msgs = sc.launch(functools.partial(_diverged, transport_kwargs=transport_kwargs), world_size=2, backend="sim")
    for m in msgs:
        assert m is not None and "lower the learning rate" in m and "opt.step_size_hint" in m, m
        assert m.index("learning rate") < m.index("nonfinite='pass'"), m
