"""``experiments/bench/transports.py``: its headline rows are the library's defaults (docs/transports.md, "Transports and
their defaults"), its tuned rows say so with their settings."""

from __future__ import annotations

import functools

import sparsecomm as sc
from experiments.bench import transports as bench


def test_headline_rows_construct_transports_with_no_keywords():
    headline = [c for c in bench.CASES if not c.tuned]
    assert {c.transport for c in headline} == set(sc.transports.available())
    for c in headline:
        assert c.kwargs == {} and c.label == c.transport, c
        assert all(":" not in spec for spec in c.services), c          # services with no program arguments
    for c in bench.CASES:
        if c.tuned:
            assert c.label.startswith(f"{c.transport} (tuned: ") and all(f"{k}={v}" in c.label
                                                                        for k, v in c.kwargs.items()), c
    assert bench.REFERENCE in bench.CASES and bench.REFERENCE.kwargs == {"inplace": True}


def test_the_benchmark_builds_its_headline_transports_with_no_keywords(monkeypatch):
    """What ``bench_worker`` passes to ``sc.transports.get`` for the headline cases (on the SimFabric,
    where every transport but ``native`` runs): no keyword at all."""
    calls = []
    get = sc.transports.get

    def spy(name, fabric, **kw):
        calls.append((name, kw))
        return get(name, fabric, **kw)

    monkeypatch.setattr(bench.sc.transports, "get", spy)
    cases = [c for c in bench.CASES if not c.tuned and c.transport != "native"]
    sc.launch(functools.partial(bench.bench_worker, cases=cases, numel=4096, repeats=1, warmup=0), 2)
    assert sorted({name for name, _ in calls}) == sorted(c.transport for c in cases)
    assert all(kw == {} for _, kw in calls), calls
