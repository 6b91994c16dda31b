"""Adding a component is one new file plus its registration (CONTRIBUTING.md, "Adding a component"): every
registered compressor, method and transport has its theory (closed forms in theory/) and its tests."""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path

import pytest
import torch

import sparsecomm as sc
from sparsecomm.theory import compressors as th_compressors
from sparsecomm.theory import costs

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: theory/compressors.py and the modules it re-exports (the wire bits, the methods' own operators)
THEORY_COMPRESSORS = {(Path(th_compressors.__file__).parent / f).resolve()
                      for f in ("compressors.py", "bits.py", "method_operators.py")}

#: hyper-parameters a method needs to be built in this check (none: its defaults)
METHOD_KW = {"dgc": {"ratio": 0.1}}


@contextlib.contextmanager
def theory_calls():
    """Record the functions of theory/compressors.py called inside the block (this thread only)."""
    seen: list[str] = []

    def prof(frame, event, arg):
        if event == "call" and Path(frame.f_code.co_filename).resolve() in THEORY_COMPRESSORS:
            seen.append(frame.f_code.co_name)

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        yield seen
    finally:
        sys.setprofile(old)


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def _compressor_cases() -> dict[str, dict]:
    from tests.compressors.test_compressors_contract import CASES

    out: dict[str, dict] = {}
    for name, kw in CASES:
        out.setdefault(name, kw)
    return out


# ------------------------------------------------------------------------------------- compressors
def test_every_compressor_is_in_the_contract_matrix():
    missing = sorted(set(sc.compressors.available()) - set(_compressor_cases()))
    assert not missing, f"add a case to tests/compressors/test_compressors_contract.py CASES for {missing}"


@pytest.mark.parametrize("name", sc.compressors.available())
def test_every_compressor_reads_its_constants_in_theory(name):
    """omega (unbiased) or delta (contractive), and bits, come from theory/compressors.py."""
    kw = _compressor_cases().get(name)
    if kw is None:
        pytest.fail(f"{name}: no case in the contract matrix (see the test above)")
    c = sc.compressors.get(name, **kw)
    d = 1000
    # the declared bound: omega (unbiased) or delta (contractive); an operator without a contraction
    # guarantee (delta = 0, e.g. threshold) states its bound in a ``*_bound`` method instead
    extra = [getattr(c, n) for n in dir(c) if n.endswith("_bound") and callable(getattr(c, n))]
    with theory_calls() as seen:
        c.omega(d) if c.unbiased else c.delta(d)
        for f in extra:
            f(d)
    assert seen, f"{name}: its omega/delta (or *_bound) is not read from theory/compressors.py"
    with theory_calls() as seen:
        c.bits(d)
    assert seen, f"{name}: bits({d}) is not read from theory/compressors.py"


# ------------------------------------------------------------------------------------------ methods
@pytest.mark.parametrize("name", sc.methods.available())
def test_every_method_reads_its_operator_constants_in_theory(name):
    """The operator a method sends (its own, or its default compressor) declares its bits and bounds
    through theory/compressors.py."""
    m = sc.methods.get(name, **METHOD_KW.get(name, {}))
    op = m.compressor
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(0))
    op.compress(x, torch.Generator().manual_seed(1))   # compile kernels before profiling (slow under a profiler)
    with theory_calls() as seen:
        with contextlib.suppress(NotImplementedError):
            op.omega(x.numel()) if op.unbiased else op.delta(x.numel())
        with contextlib.suppress(NotImplementedError):
            op.bits(x.numel())
        op.compress(x, torch.Generator().manual_seed(1))
    assert seen, f"method {name!r}: its operator {type(op).__name__} reads nothing from theory/compressors.py"


def test_every_method_has_tests():
    names = set().union(*(_string_constants(p) for p in TESTS.rglob("test_methods*.py")))
    missing = sorted(set(sc.methods.available()) - names)
    assert not missing, f"no tests/**/test_methods*.py names method(s) {missing}"


# --------------------------------------------------------------------------------------- transports
def test_every_transport_has_a_cost_model():
    missing = sorted(set(sc.transports.available()) - set(costs.MODELS))
    assert not missing, f"add the cost model of {missing} to theory/costs.py MODELS"
    assert all(callable(f) for f in costs.MODELS.values())


def test_every_transport_has_tests():
    """A transport's tests are tests/transports/**/test_<name>.py; the dense baselines share
    tests/transports/test_transports_baseline.py."""
    baseline = _string_constants(TESTS / "transports" / "test_transports_baseline.py")
    missing = [name for name in sc.transports.available()
               if not any((TESTS / "transports").rglob(f"test_{name.replace('-', '_')}.py")) and name not in baseline]
    assert not missing, f"no tests for transport(s) {missing}"


def test_the_probe_sees_theory_calls_and_only_those():
    with theory_calls() as seen:
        th_compressors.randk_omega(10, 2)
        abs(-1.0)
    assert seen == ["randk_omega"]
    with theory_calls() as seen:
        torch.ones(3).sum()
    assert seen == []
