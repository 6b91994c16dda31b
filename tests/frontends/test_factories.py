"""Typed factories are the API; each kind has one name -> factory catalog (``sparsecomm.registry``), and a
keyword nothing takes is reported once, by the catalog, naming the parameters that would be taken."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import HyperParameterError

PKG = Path(sc.__file__).resolve().parent

#: the catalog entries that take parts by name (``get("compose", first="randk", second="natural",
#: ratio=0.01)``): their typed factories take Compressor objects
BY_NAME_ONLY = {"compose", "induced"}

#: a by-name build and its typed twin (the same operator, the same hyper-parameters)
TWINS = [
    (lambda: sc.compressors.randk(ratio=0.1), lambda: sc.compressors.get("randk", ratio=0.1)),
    (lambda: sc.compressors.randk(k=7, independent=True), lambda: sc.compressors.get("randk", k=7, independent=True)),
    (lambda: sc.compressors.topk(ratio=0.2), lambda: sc.compressors.get("topk", ratio=0.2)),
    (lambda: sc.compressors.qsgd(3, bucket_size=64), lambda: sc.compressors.get("qsgd", levels=3, bucket_size=64)),
    (lambda: sc.compressors.terngrad(bucket_size=32), lambda: sc.compressors.get("terngrad", bucket_size=32)),
    (lambda: sc.compressors.natural(), lambda: sc.compressors.get("natural")),
    (lambda: sc.compressors.natural_dithering(2, p=2), lambda: sc.compressors.get("natural_dithering", levels=2)),
    (lambda: sc.compressors.sign(), lambda: sc.compressors.get("sign")),
    (lambda: sc.compressors.identity(), lambda: sc.compressors.get("identity")),
    (lambda: sc.compressors.none(), lambda: sc.compressors.get("identity")),
    (lambda: sc.compressors.fp16(underflow="allow"), lambda: sc.compressors.get("fp16", underflow="allow")),
    (lambda: sc.compressors.bf16(), lambda: sc.compressors.get("bf16")),
    (lambda: sc.compressors.threshold(0.5), lambda: sc.compressors.get("threshold", threshold=0.5)),
    (lambda: sc.compressors.compose(sc.compressors.randk(ratio=0.1), sc.compressors.natural()),
     lambda: sc.compressors.get("compose", first="randk", second="natural", ratio=0.1)),
    (lambda: sc.compressors.induced(sc.compressors.topk(ratio=0.1), sc.compressors.randk(ratio=0.1)),
     lambda: sc.compressors.get("induced", first="topk", second="randk", ratio=0.1)),
]


@pytest.mark.parametrize("kind", ["compressors", "methods"])
def test_every_catalog_name_has_a_typed_factory(kind):
    """Each name maps to the package's typed factory of that name: real keyword parameters, no
    ``**kwargs`` (the compositions by name route keywords to their named parts)."""
    pkg = getattr(sc, kind)
    for name in pkg.available():
        typed = getattr(pkg, name)
        assert callable(typed) and not inspect.ismodule(typed), name
        params = inspect.signature(typed).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), f"{kind}.{name} takes **kwargs"
        if name not in BY_NAME_ONLY:
            assert pkg.registry.factory(name) is typed, name


@pytest.mark.parametrize("i", range(len(TWINS)))
def test_typed_factory_equals_the_catalog(i):
    typed, named = TWINS[i]
    a, b = typed(), named()
    assert type(a) is type(b) and repr(a) == repr(b)
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    pa = a.compress(x, torch.Generator().manual_seed(5))
    pb = b.compress(x, torch.Generator().manual_seed(5))
    assert torch.equal(a.decompress(pa), b.decompress(pb))


def test_methods_take_typed_compressors():
    rk = sc.compressors.randk(ratio=0.01)
    m = sc.methods.diana(rk)
    assert m.compressor is rk and m.name == "diana"
    assert repr(sc.methods.ef21(sc.compressors.topk(ratio=0.1), init="zeros")) == \
        repr(sc.methods.get("ef21", compressor="topk", ratio=0.1, init="zeros"))
    assert sc.methods.build(sc.compressors.randk(ratio=0.1), "diana").compressor.size(100) == 10


def _raised(fn) -> HyperParameterError:
    with pytest.raises(HyperParameterError) as e:
        fn()
    # reported once: not a re-raise of another error
    assert e.value.__cause__ is None and e.value.__context__ is None
    return e.value


def test_a_bad_keyword_names_the_accepted_parameters_once():
    msg = str(_raised(lambda: sc.compressors.get("qsgd", ratio=0.1)))
    assert "'ratio'" in msg and "takes: levels, bucket_size)" in msg
    msg = str(_raised(lambda: sc.methods.get("diana", compressor="randk", ratio=0.1, aplha=0.5)))
    assert "'aplha'" in msg and "takes: ratio, k, independent;" in msg and "compressor, alpha, init" in msg
    msg = str(_raised(lambda: sc.methods.get("powersgd", ratio=0.1)))
    assert "matrix_approximation_rank, start_powerSGD_iter, min_compression_rate" in msg
    msg = str(_raised(lambda: sc.transports.get("ring", None, block_size=3)))
    assert "'block_size'" in msg and "transport 'ring'" in msg

    def opt():
        def fn(ctx):
            sc.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1),
                                    compressor="diana", ratio=0.5, bukcet_cap_mb=1)
        sc.launch(fn, world_size=1, backend="sim")
    with pytest.raises(Exception, match="'bukcet_cap_mb'.*compressor 'randk' takes.*method 'diana' takes"):
        opt()


def test_the_optimizer_takes_typed_objects_bit_identically():
    """``compressor=sc.compressors.randk(...), method="diana"`` is the run of ``compressor="randk",
    method="diana", ratio=...``, and so is a typed Method object as ``method=``, the flat command-line
    form ``compressor="diana"`` and, with a FutureWarning naming ``method=``, a Method object given as
    ``compressor=``."""
    def run(how):
        def fn(ctx):
            with ctx.seeded(0):
                model = torch.nn.Linear(16, 1)
            kw = {"named": dict(compressor="randk", method="diana", ratio=0.25),
                  "compressor": dict(compressor=sc.compressors.randk(ratio=0.25), method="diana"),
                  "method": dict(method=sc.methods.diana(sc.compressors.randk(ratio=0.25))),
                  "method_name": dict(method="diana", ratio=0.25),
                  "flat": dict(compressor="diana", ratio=0.25),
                  "legacy": dict(compressor=sc.methods.diana(sc.compressors.randk(ratio=0.25)))}[how]
            opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), transport="ring", **kw)
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in range(3):
                x = torch.randn(8, 16, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                opt.step()
            return model.weight.detach().clone()
        return sc.launch(fn, world_size=2, backend="sim")
    ref = run("named")
    for how in ("compressor", "method", "method_name", "flat"):
        assert all(torch.equal(a, b) for a, b in zip(ref, run(how))), how
    with pytest.warns(FutureWarning, match="use method="):
        legacy = run("legacy")
    assert all(torch.equal(a, b) for a, b in zip(ref, legacy))


def test_compressor_takes_compressors_and_method_takes_methods():
    """A Method object goes to ``method=`` (its compressor is its own); ``method=`` takes no compressor
    object and ``compressor=`` no other type."""
    from sparsecomm.errors import InvalidTypeError

    m = sc.methods.ef(sc.compressors.topk(ratio=0.1))
    assert sc.methods.build(method=m) is m
    with pytest.raises(InvalidTypeError, match="belong to its constructor"):
        sc.methods.build(sc.compressors.topk(ratio=0.2), method=m)
    with pytest.raises(InvalidTypeError, match="method must be"):
        sc.methods.build(method=sc.compressors.topk(ratio=0.2))
    with pytest.raises(InvalidTypeError, match="method= was given too|pass the method object alone"):
        sc.methods.build(m, method="ef")
    assert sc.methods.build(method="ef").compressor.name == "topk"     # its default compressor


def test_only_the_catalog_reads_signatures():
    """No routing by introspection: ``inspect.signature`` appears in sparsecomm/registry.py only."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "signature" and \
                    ast.unparse(node.value) == "inspect" and path.name != "registry.py":
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert bad == []
