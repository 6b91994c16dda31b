"""The fork server of the gloo backend preloads the optimizer stack and initialises Numba's CPU target once per
parent (launch/base.preload, sparsecomm/_numba_warm.py), without changing a rank's results."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

import sparsecomm as sc
from sparsecomm.errors import InvalidTypeError
from sparsecomm.launch import base


def _numba_initialised() -> bool:
    """Whether this process's Numba CPU target has its built-in implementations installed (what the first
    kernel call, or the warm-up, does; importing the kernels' modules does not)."""
    from numba.core.imputils import builtin_registry
    from numba.core.registry import cpu_target

    return builtin_registry in cpu_target.target_context._registries


def _kernel_results(seed: int) -> dict:
    """The kernels EF + top-k runs on a CPU float32 bucket (abs max, top-k indices, gather), on seeded data."""
    from sparsecomm.compressors._common import abs_max, gather
    from sparsecomm.compressors.topk import topk_indices

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(seed))
    idx = topk_indices(x, 100)
    vals, finite = gather(x, idx, 0.5)
    return {"absmax": abs_max(x), "idx": idx, "vals": vals, "finite": finite}


def _fresh_kernel_sum(n: int) -> float:
    """A kernel compiled here and now (no cache): the forked, pre-initialised target still compiles."""
    import numba
    import numpy as np

    @numba.njit(cache=False)
    def total(a):
        s = 0.0
        for v in a:
            s += v
        return s

    return float(total(np.arange(n, dtype=np.float64)))


def _at_start(ctx, seed: int) -> dict:
    # read before this function imports anything of the library's
    state = {"optim": "sparsecomm.optim" in sys.modules, "numba": _numba_initialised()}
    return {**state, **_kernel_results(seed), "fresh": _fresh_kernel_sum(100)}


@pytest.mark.multiprocess
def test_forked_ranks_start_with_the_optimizer_stack_and_numba_initialised_and_compute_the_same():
    out = sc.launch(functools.partial(_at_start, seed=3), 2, backend="gloo", timeout_s=60)
    assert [(o["optim"], o["numba"]) for o in out] == [(True, True)] * 2
    here = _kernel_results(3)          # this process initialised its target itself, at the first kernel call
    for o in out:
        assert o["absmax"] == here["absmax"] and o["finite"] == here["finite"]
        assert torch.equal(o["idx"], here["idx"]) and torch.equal(o["vals"], here["vals"])
        assert o["fresh"] == 4950.0


def test_the_package_declares_its_preloads_and_preload_keeps_one_entry_per_module(monkeypatch):
    assert {"sparsecomm.optim", "sparsecomm._numba_warm"} <= set(base.preloads())
    monkeypatch.setattr(base, "_preloads", [])
    base.preload("a.b", "c")
    base.preload("c", "a.b", "d")
    assert base.preloads() == ["a.b", "c", "d"]
    for bad in ("", None, 3):
        with pytest.raises(InvalidTypeError, match="module names"):
            base.preload(bad)  # type: ignore[arg-type]
    assert base.preloads() == ["a.b", "c", "d"]


def test_numba_warm_up_initialises_the_target_and_never_raises(monkeypatch):
    from numba.core import registry

    import sparsecomm._numba_warm as warm

    assert warm.WARMED and warm.warm() and _numba_initialised()

    class Broken:
        @property
        def target_context(self):
            raise RuntimeError("no LLVM here")

    monkeypatch.setattr(registry, "cpu_target", Broken())
    assert warm.warm() is False          # a fork server importing it must survive (only ImportError is)


def _train(ctx) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="topk", method="ef",
                                  ratio=0.05)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ef_topk_steps_are_bit_identical_with_the_preloading_fork_server_and_with_spawned_ranks():
    forked = sc.launch(_train, 2, backend="gloo", timeout_s=120)
    spawned = sc.launch(_train, 2, backend="gloo", start_method="spawn", timeout_s=120)
    for f, s in zip(forked, spawned):
        assert all(torch.equal(a, b) for a, b in zip(f, s))
