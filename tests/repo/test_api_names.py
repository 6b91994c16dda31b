"""The public names a user meets first: the package facade and the catalog of what ``compressor=`` takes."""

from __future__ import annotations

import pytest
import torch

import sparsecomm as sc


def test_the_facade_lists_only_public_names():
    names = dir(sc)
    assert len(names) == len(set(names))
    assert not {"annotations", "importlib", "_LAZY", "_tree", "_backends"} & set(names)
    assert names == sorted(sc.__all__)
    for n in sc.__all__:                 # every listed name resolves (lazily loaded or not)
        assert getattr(sc, n) is not None, n
    assert {"DistributedOptimizer", "ddp", "launch", "methods", "compressors", "transports"} <= set(names)


def test_compressor_choices_is_what_compressor_takes():
    """``sc.compressors.available()`` lists compressors only; ``compressor=`` also takes methods, and
    ``sc.methods.compressor_choices()`` lists both: every name in it builds through the optimizer's rule,
    and the error for a name in neither points at it."""
    from sparsecomm.errors import UnknownNameError

    choices = sc.methods.compressor_choices()
    assert choices == {"methods": sc.methods.available(), "compressors": sc.compressors.available()}
    assert "diana" in choices["methods"] and "diana" not in sc.compressors.available()
    required = {"randk": {"ratio": 0.5}, "topk": {"ratio": 0.5}, "threshold": {"threshold": 0.1},
                "compose": {"first": "randk", "second": "natural", "ratio": 0.5},
                "induced": {"first": "topk", "second": "randk", "ratio": 0.5}}
    for name in choices["methods"] + choices["compressors"]:
        assert isinstance(sc.methods.build(name, **required.get(name, {})), sc.methods.Method), name
    with pytest.raises(UnknownNameError, match=r"compressor_choices\(\)"):
        sc.methods.build("dianna")


def _opt(ctx, **kw):
    model = torch.nn.Linear(4, 1)
    return sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def test_unknown_compressor_through_the_optimizer_names_the_catalog():
    from sparsecomm.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match=r"methods: .*diana.*compressors: .*randk"):
        sc.launch(lambda ctx: _opt(ctx, compressor="dianna"), world_size=1, backend="sim")
