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
    """The kernels EF + top-k runs on a CPU float32 bucket (abs max, top-k indices, gather), and the DDP hook's
    plain average (its division with the finiteness check), on seeded data."""
    from sparsecomm.compressors._common import abs_max, divide_finite, gather
    from sparsecomm.compressors.topk import topk_indices

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(seed))
    idx = topk_indices(x, 100)
    vals, finite = gather(x, idx, 0.5)
    avg = x.clone()
    return {"absmax": abs_max(x), "idx": idx, "vals": vals, "finite": finite,
            "average": (avg, divide_finite(avg, 2))}


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
        assert torch.equal(o["average"][0], here["average"][0]) and o["average"][1] == here["average"][1]
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


def _default_path_overloads(ctx) -> dict:
    """The signatures the default path's kernels hold in this rank before its first EF + top-k step and after
    its second (the rank imports nothing of the library's before the first look)."""
    from sparsecomm.compressors import _kernels

    def held() -> dict:
        return {d.py_func.__name__: sorted(str(s) for s in d.overloads)
                for d, _ in _kernels.default_path_signatures()}

    before = held()
    _train(ctx)
    return {"before": before, "after": held()}


def _warm_the_cache() -> None:
    """This process runs the default path's kernels once (compiling them if Numba's cache lacks them, which
    writes them there), so that a fork server started afterwards finds them."""
    _kernel_results(0)


@pytest.mark.multiprocess
def test_forked_ranks_start_with_the_default_paths_kernels_loaded():
    """With the kernels in Numba's cache, the fork server loads them (sparsecomm._numba_warm.load_cached):
    a forked rank's dispatchers hold the declared signatures before its first step, and its steps add none
    (the declaration is exactly what the default path runs). A fresh interpreter starts the launch, so the
    fork server is one that starts after the cache is warm."""
    import json
    import os
    import subprocess
    from pathlib import Path

    _warm_the_cache()
    root = Path(__file__).resolve().parents[2]
    code = ("import json, sparsecomm as sc\n"
            "from tests.frontends.test_launch_preload import _default_path_overloads\n"
            "if __name__ == '__main__':\n"
            "    print(json.dumps(sc.launch(_default_path_overloads, 2, backend='gloo', timeout_s=120)))\n")
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    from sparsecomm.compressors import _kernels

    declared = {d.py_func.__name__: [str(tuple(s))] for d, s in _kernels.default_path_signatures()}
    for o in out:
        assert o["before"] == declared and o["after"] == declared


def test_loading_from_the_cache_compiles_nothing():
    """A signature the cache lacks is left to the kernel's first call: the dispatcher holds no new overload."""
    import numpy as np
    from numba import typeof

    from sparsecomm import _numba_warm
    from sparsecomm.compressors import _kernels

    sig = (typeof(np.zeros(1, np.int8)), typeof(np.zeros(1, np.int8)))    # never called with these types
    before = set(_kernels.copy_finite.overloads)
    assert _numba_warm.load_cached([(_kernels.copy_finite, sig)]) == 0
    assert set(_kernels.copy_finite.overloads) == before and sig not in before
    assert _numba_warm.load_cached([(_kernels.copy_finite, ("not a type",))]) == 0     # never raises
