"""The gloo launcher: results, context, failure propagation, timeouts, argument checks, torchrun mode."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import FabricTimeout
from sparsecomm.launch import current_context

REPO = Path(__file__).resolve().parents[2]


def _report(ctx, scale):
    assert current_context() is ctx
    return {"rank": ctx.rank, "n": ctx.world_size, "backend": ctx.backend, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "value": torch.arange(3) * scale * ctx.rank}


@pytest.mark.multiprocess
def test_results_come_back_in_rank_order_from_separate_processes():
    out = sc.launch(functools.partial(_report, scale=10), 3, backend="gloo", timeout_s=30)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["n"] == 3 and o["backend"] == "gloo" and o["threads"] == 1 for o in out)
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4
    assert torch.equal(out[2]["value"], torch.tensor([0, 20, 40]))


def _fail_on_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank one")
    # the others wait for a message that never comes: the launcher must end them, not hang
    ctx.fabric.recv(torch.zeros(1), 1, tag=3)


@pytest.mark.multiprocess
def test_failure_on_one_rank_ends_every_rank_with_that_error():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom on rank one") as info:
        sc.launch(_fail_on_one, 3, backend="gloo", timeout_s=60)
    assert time.perf_counter() - t0 < 30          # far below the 60 s timeout
    notes = "\n".join(info.value.__notes__)
    assert "worker 1" in notes and "_fail_on_one" in notes   # the remote traceback


def _stall(ctx):
    if ctx.rank == 2:
        time.sleep(8)                       # never joins the collective
        return None
    sc.transports.get("ring", ctx.fabric).allreduce(torch.ones(10))


@pytest.mark.multiprocess
def test_a_collective_waiting_longer_than_the_timeout_raises_on_every_waiting_rank():
    t0 = time.perf_counter()
    with pytest.raises(FabricTimeout) as info:
        sc.launch(_stall, 3, backend="gloo", timeout_s=1.5)
    assert time.perf_counter() - t0 < 8
    text = str(info.value) + "\n".join(info.value.__notes__)
    assert "worker 0" in text and "worker 1" in text, text    # both waiting ranks timed out


def _unpicklable_result(ctx):
    return lambda: None


@pytest.mark.multiprocess
def test_unpicklable_function_or_result_is_a_clear_error():
    with pytest.raises(TypeError, match="picklable"):
        sc.launch(lambda ctx: 0, 2, backend="gloo")
    with pytest.raises(TypeError, match="cannot be pickled"):
        sc.launch(_unpicklable_result, 2, backend="gloo", timeout_s=30)


def test_bad_options_are_rejected_before_starting_anything():
    with pytest.raises(TypeError, match="sim"):
        sc.launch(_report, 2, backend="gloo", network=sc.Network())
    with pytest.raises(TypeError, match="unexpected options"):
        sc.launch(_report, 2, backend="gloo", bogus=1)
    with pytest.raises(ValueError, match="start_method"):
        sc.launch(_report, 2, backend="gloo", start_method="fork")
    with pytest.raises(sc.errors.UnknownNameError, match="gloo.*nccl.*sim"):
        sc.launch(_report, 2, backend="mpi")


TORCHRUN_SCRIPT = '''
import os, torch
import sparsecomm as sc
import sparsecomm.transports
from sparsecomm.fabric import services
from sparsecomm.errors import ServiceShutdown

def doubler(arg):
    def main(fabric):
        while True:
            buf = torch.zeros(1)
            src = fabric.recv(buf, None, tag=7)
            fabric.send(buf * 2, src, tag=8)
    return main

services.registry.register("doubler")(doubler)

def fn(ctx):
    f = ctx.fabric
    f.send(torch.tensor([float(ctx.rank + 1)]), f.service("doubler"), tag=7)
    out = torch.zeros(1)
    f.recv(out, f.service("doubler"), tag=8)
    y = sc.transports.get("ring", f).allreduce(torch.ones(4) * (ctx.rank + 1))
    return [out.item(), y.tolist()]

if __name__ == "__main__":
    res = sc.launch(fn, 2, backend="gloo", services=("doubler",), timeout_s=60)
    # one file per rank: prints of three processes on one pipe can interleave mid-line
    with open(f"result{os.environ['RANK']}.txt", "w") as fh:
        fh.write(f"RESULT {os.environ['RANK']} {res}")
'''


@pytest.mark.multiprocess
def test_under_torchrun_each_process_is_one_rank_and_gets_every_result(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [(tmp_path / f"result{r}.txt").read_text() for r in range(3)
             if (tmp_path / f"result{r}.txt").exists()]
    expect = "[[2.0, [3.0, 3.0, 3.0, 3.0]], [4.0, [3.0, 3.0, 3.0, 3.0]]]"
    assert lines == [f"RESULT {r} {expect}" for r in range(3)], proc.stdout + proc.stderr


def _hello(ctx):
    return ctx.rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spawn_start_method():
    assert sc.launch(_hello, 2, backend="gloo", start_method="spawn", timeout_s=60) == [0, 1]


EVIL_SCRIPT = '''
import os, sys, torch
import sparsecomm as sc

class Evil:
    def __reduce__(self):
        return (os._exit, (13,))          # would end the unpickling process with code 13

def fn(ctx):
    return Evil() if ctx.rank == 1 else {"rank": ctx.rank, "t": torch.arange(3) * ctx.rank}

def ok(ctx):
    return {"rank": ctx.rank, "t": torch.arange(3) * ctx.rank}

if __name__ == "__main__":
    import torch.distributed as dist
    dist.init_process_group("gloo")      # one process group for both launches (launch runs in place)
    good = sc.launch(ok, 2, backend="gloo", timeout_s=60)
    try:
        sc.launch(fn, 2, backend="gloo", timeout_s=60)
        outcome = "no error"
    except TypeError as e:
        outcome = "TypeError " + ("worker 1" in str(e) or "Evil" in str(e)).__str__()
    with open(f"out{os.environ['RANK']}.txt", "w") as fh:
        fh.write(f"{[g['rank'] for g in good]} {good[1]['t'].tolist()} {outcome}")
    dist.barrier()
    dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_torchrun_results_cross_ranks_without_pickle(tmp_path):
    """A result whose unpickling would run code is refused on every rank (TypeError), nothing exits."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(EVIL_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outs = [(tmp_path / f"out{r}.txt").read_text() for r in range(2)]
    assert outs == ["[0, 1] [0, 1, 2] TypeError True"] * 2, outs


def _threads(ctx):
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


@pytest.mark.multiprocess
def test_ranks_get_cores_over_ranks_threads_unless_omp_num_threads_is_set(monkeypatch):
    from sparsecomm.launch.base import threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    k = threads_per_rank(2)
    assert sc.launch(_threads, 2, backend="gloo") == [(k, str(k))] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert sc.launch(_threads, 2, backend="gloo") == [(3, "3")] * 2
    assert threads_per_rank(1) == max(1, os.cpu_count() or 1) and threads_per_rank(10 ** 6) == 1


def _cores_and_service(ctx):
    """This worker's cores, and the service rank's (it reads them from the kernel: the service is no worker)."""
    f = ctx.fabric
    buf = torch.zeros(1)
    f.send(buf, f.service("echo-cores"), tag=11)
    got = torch.zeros(64, dtype=torch.int64)
    f.recv(got, f.service("echo-cores"), tag=12)
    return sorted(os.sched_getaffinity(0)), sorted(int(c) for c in got.tolist() if c >= 0)


def _echo_cores(arg):
    def main(fabric):
        while True:
            buf = torch.zeros(1)
            src = fabric.recv(buf, None, tag=11)
            cores = sorted(os.sched_getaffinity(0))
            out = torch.full((64,), -1, dtype=torch.int64)
            out[:len(cores)] = torch.tensor(cores)
            fabric.send(out, src, tag=12)
    return main


from sparsecomm.fabric import services as _services  # noqa: E402

_services.registry.register("echo-cores")(_echo_cores)


@pytest.mark.multiprocess
def test_pinned_ranks_each_run_on_one_core_in_turn_and_unpinned_ones_where_the_scheduler_puts_them():
    """``pin_cores=True``: rank r (workers, then the services) on the r-th core of the parent's, in turn, its
    threads too (set before any starts); off, every rank keeps the parent's cores."""
    from sparsecomm.launch.torch_backend import rank_cores

    mine = sorted(os.sched_getaffinity(0))
    cores = rank_cores(3)
    assert cores == [mine[r % len(mine)] for r in range(3)]
    out = sc.launch(_cores_and_service, 2, backend="gloo", services=["echo-cores"], timeout_s=60, pin_cores=True)
    assert [o[0] for o in out] == [[cores[0]], [cores[1]]]
    assert out[0][1] == out[1][1] == [cores[2]]            # the service rank: the next core in turn
    out = sc.launch(_cores_and_service, 2, backend="gloo", services=["echo-cores"], timeout_s=60)
    assert all(o[0] == mine and o[1] == mine for o in out)
    with pytest.raises(TypeError, match="pin_cores"):
        sc.launch(_report, 2, backend="gloo", pin_cores=1)
