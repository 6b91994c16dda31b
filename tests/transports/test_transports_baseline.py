"""Baseline transports (ring, allgather, native) on SimFabric and on real gloo processes.

Inputs are integer-valued (or dyadic) floats, so every sum is exact and compared bit for bit. Every rank
builds every rank's input from seeds, so it knows the exact expected sum locally. The checks run inside
one launched function per world size (``check_all``), which returns the list of problems it found.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401  (registers the transports; preloaded by the gloo launcher)
from sparsecomm.errors import FabricTimeout, IncompatibleError, MismatchError, PeerFailure
from sparsecomm.payload import Payload

SIZES = (0, 1, 7, 100)
KINDS = ("tensor", "dense", "dense32", "aligned", "sparse", "quantized_shared", "quantized_unshared")
CARRIES = {
    "ring": {"tensor", "dense", "dense32", "aligned", "quantized_shared"},
    "native": {"tensor", "dense", "dense32", "aligned", "quantized_shared"},
    "allgather": set(KINDS),
}


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) & 0x7FFFFFFF)


def make_input(kind: str, rank: int, numel: int, case: int) -> torch.Tensor | Payload:
    """Worker ``rank``'s input of ``kind`` (float64 original dtype; exact sums)."""
    g = _gen(case, rank)
    shape = torch.Size([numel])
    ints = torch.randint(-50, 51, (numel,), generator=g).double()
    if kind == "tensor":
        return ints
    if kind == "dense":
        return Payload("dense", ints.clone(), shape, torch.float64)
    if kind == "dense32":   # a narrower wire dtype: summed in float32, exact for small integers
        return Payload("dense", ints.float(), shape, torch.float64)
    if kind == "aligned":   # shared indices (same generator on every worker), worker-specific values
        k = numel // 2
        idx = torch.randperm(numel, generator=_gen(case, 999))[:k]
        return Payload("aligned", ints[:k].clone(), shape, torch.float64, indices=idx)
    if kind == "sparse":    # worker-specific indices; k = 0 for small tensors
        k = numel // 3
        idx = torch.randperm(numel, generator=g)[:k]
        return Payload("sparse", ints[:k].clone(), shape, torch.float64, indices=idx)
    if kind in ("quantized_shared", "quantized_unshared"):
        bucket = 4
        nb = -(-numel // bucket)
        codes = torch.randint(-127, 128, (numel,), generator=g).to(torch.int8)
        if kind == "quantized_shared":
            scale = torch.pow(2.0, -torch.arange(nb, dtype=torch.float64) % 5)
        else:
            scale = torch.pow(2.0, -((torch.arange(nb, dtype=torch.float64) + rank) % 5))
        return Payload("quantized", codes, shape, torch.float64, scale=scale, bucket_size=bucket,
                       shared_scale=kind == "quantized_shared")
    raise ValueError(kind)


def expected(kind: str, n: int, numel: int, case: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float64)
    for r in range(n):
        x = make_input(kind, r, numel, case)
        out += x if isinstance(x, torch.Tensor) else x.to_dense()
    return out


def _expect_error(problems: list, label: str, exc_type, fn, *must_contain: str) -> None:
    try:
        fn()
    except exc_type as e:
        for s in must_contain:
            if s not in str(e):
                problems.append(f"{label}: message lacks {s!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        problems.append(f"{label}: raised {type(e).__name__}: {e}, expected {exc_type.__name__}")
        return
    problems.append(f"{label}: no error, expected {exc_type.__name__}")


def check_all(ctx, transports=("ring", "allgather")) -> tuple[int, list[str]]:
    """Run every check on this worker; return (number of sums checked, problems).

    ``transports``: names, or ``(name, kwargs)`` pairs.
    """
    f = ctx.fabric
    n, r = ctx.world_size, ctx.rank
    problems: list[str] = []
    checked = 0
    case = 0
    for spec in transports:
        name, kwargs = (spec, {}) if isinstance(spec, str) else spec
        t = sc.transports.get(name, f, **kwargs)
        for kind in KINDS:
            for numel in SIZES:
                case += 1
                x = make_input(kind, r, numel, case)
                if kind not in CARRIES[name]:
                    continue
                y = t.allreduce(x)
                want = expected(kind, n, numel, case)
                checked += 1
                if y.dtype != torch.float64 or y.shape != want.shape or not torch.equal(y, want):
                    problems.append(f"{name}/{kind}/numel={numel}: wrong sum {y[:5].tolist()} vs "
                                    f"{want[:5].tolist()}")
                if n > 1 and numel >= n and kind == "tensor" and t.last_stats.bytes_sent <= 0:
                    problems.append(f"{name}: last_stats not recorded")
        # multi-dimensional tensors keep their shape
        case += 1
        x2 = make_input("tensor", r, 12, case).reshape(3, 4)
        y2 = t.allreduce(x2)
        if y2.shape != (3, 4) or not torch.equal(y2.reshape(-1), expected("tensor", n, 12, case)):
            problems.append(f"{name}: 2-d tensor sum wrong")
        # payload kinds it cannot carry: a clear error naming an alternative
        for kind in KINDS:
            if kind not in CARRIES[name]:
                _expect_error(problems, f"{name}/{kind} incompatible", IncompatibleError,
                              lambda: t.allreduce(make_input(kind, r, 8, 0)), "allgather")
        if n > 1:
            # lengths, dtypes, shared indices, shared scales that differ: MismatchError on every rank
            last = n - 1
            _expect_error(problems, f"{name} length mismatch", MismatchError,
                          lambda: t.allreduce(torch.ones(5 + (r == last))), "disagree", "length")
            _expect_error(problems, f"{name} dtype mismatch", MismatchError,
                          lambda: t.allreduce(torch.ones(5, dtype=torch.float32 if r == 0 else torch.float64)),
                          "disagree", "float32", "float64")
            idx = torch.arange(4) + (1 if r == last else 0)
            _expect_error(problems, f"{name} aligned indices mismatch", MismatchError,
                          lambda: t.allreduce(Payload("aligned", torch.ones(4), torch.Size([8]), torch.float64,
                                                      indices=idx)), "indices")
            if name != "allgather":
                sc_ = torch.tensor([1.0, 0.5 if r == last else 0.25])
                _expect_error(problems, f"{name} scale not shared", MismatchError,
                              lambda: t.allreduce(Payload("quantized", torch.ones(8, dtype=torch.int8),
                                                          torch.Size([8]), torch.float64, scale=sc_,
                                                          bucket_size=4, shared_scale=True)), "scale")
            # the fabric is clean after the errors: a normal call still sums exactly
            case += 1
            y = t.allreduce(make_input("tensor", r, 33, case))
            if not torch.equal(y, expected("tensor", n, 33, case)):
                problems.append(f"{name}: wrong sum after mismatch errors")
    return checked, problems


def check_all_coalesced(ctx, transports) -> tuple[int, list[str]]:
    """``check_all`` over a TorchFabric that defers isend/irecv into groups, as it does for nccl."""
    from sparsecomm.fabric.torch.torch_fabric import TorchFabric
    from sparsecomm.launch import Context

    fabric = TorchFabric(ctx.world_size, timeout_s=ctx.fabric.timeout_s, coalesce=True)
    return check_all(Context(ctx.rank, ctx.world_size, fabric, ctx.backend, ctx.device), transports)


def _run(n: int, backend: str, transports: tuple[str, ...], check=check_all, **kw) -> None:
    results = sc.launch(functools.partial(check, transports=transports), n, backend=backend, **kw)
    for rank, (checked, problems) in enumerate(results):
        assert not problems, f"rank {rank}: " + "\n".join(problems)
        assert checked > 20


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sim_transports_sum_exactly(n):
    # a tiny ring segment (3 float64 / 6 float32 / 24 int8 codes) exercises the pipelined segments
    _run(n, "sim", ("ring", ("ring", {"segment_bytes": 24}), "allgather"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_gloo_transports_sum_exactly(n):
    _run(n, "gloo", ("ring", ("ring", {"segment_bytes": 24}), "allgather", "native"), timeout_s=60)


@pytest.mark.multiprocess
def test_gloo_transports_sum_exactly_with_grouped_sends_and_receives():
    # nccl's mode (isend/irecv deferred to the next wait, then one batch_isend_irecv group), on gloo
    _run(3, "gloo", ("ring", ("ring", {"segment_bytes": 24}), "allgather"), check=check_all_coalesced,
         timeout_s=60)


def test_native_needs_torch_fabric():
    def fn(ctx):
        sc.transports.get("native", ctx.fabric)

    with pytest.raises(IncompatibleError, match="TorchFabric.*'ring'"):
        sc.launch(fn, 2)


def test_incompatible_payload_names_the_alternatives():
    def fn(ctx):
        p = make_input("sparse", ctx.rank, 30, 1)
        sc.transports.get("ring", ctx.fabric).allreduce(p)

    with pytest.raises(IncompatibleError, match="cannot carry 'sparse'.*allgather"):
        sc.launch(fn, 2)


def _ring_stats(ctx):
    t = sc.transports.get("ring", ctx.fabric)
    x = torch.ones(1000)
    y = t.allreduce(x)
    return y[0].item(), t.last_stats.bytes_sent, t.last_stats.bytes_received, t.last_stats.messages


def test_ring_moves_two_n_minus_one_over_n_of_the_data():
    from sparsecomm.transports._handshake import handshake_bytes

    n = 4
    out = sc.launch(_ring_stats, n)
    hs = 2 * handshake_bytes(6)   # two dissemination rounds of the six fields of a dense operand
    for total, sent, received, msgs in out:
        assert total == n
        assert sent == received == 2 * (n - 1) * 1000 * 4 // n + hs
        assert msgs == 2 * (n - 1) + 2


@pytest.mark.parametrize("name", ["ring", "allgather"])
def test_sim_crashed_rank_makes_the_others_raise(name):
    def fn(ctx):
        sc.transports.get(name, ctx.fabric).allreduce(torch.ones(64))
        return "done"

    t0 = time.perf_counter()
    with pytest.raises(FabricTimeout, match="deadlock|within"):
        sc.launch(fn, 3, network=sc.Network(crash={1: 1}, timeout_s=10))
    assert time.perf_counter() - t0 < 10


def _crash_one(ctx):
    t = sc.transports.get("ring", ctx.fabric)
    t.allreduce(torch.ones(10))            # everyone is connected and working
    if ctx.rank == 1:
        os._exit(7)
    t0 = time.monotonic()
    try:
        t.allreduce(torch.ones(1000))
    except (PeerFailure, FabricTimeout) as e:
        raise type(e)(f"[after {time.monotonic() - t0:.2f} s] {e}") from e
    return "no error"


@pytest.mark.multiprocess
def test_gloo_crashed_rank_makes_the_others_raise_within_the_timeout():
    t0 = time.perf_counter()
    with pytest.raises(PeerFailure, match="worker 1 exited with code 7") as info:
        sc.launch(_crash_one, 3, backend="gloo", timeout_s=3)
    elapsed = time.perf_counter() - t0
    notes = getattr(info.value, "__notes__", [])
    # the survivors' own errors come back as notes; they saw the failure within the timeout
    for survivor in (0, 2):
        note = next((x for x in notes if x.startswith(f"worker {survivor}:")), None)
        assert note is not None, notes
        assert float(note.split("[after ")[1].split(" s]")[0]) < 3.0, note
    assert elapsed < 3 + 2 + 10, elapsed


def _big_ring(ctx, numel):
    x = torch.full((numel,), float(ctx.rank))
    t = sc.transports.get("ring", ctx.fabric)
    y = t.allreduce(x)
    return float(y[0]), float(y[-1]), t.last_stats.modelled_time_s


def test_sim_64_workers_1m_elements_ring_is_fast():
    n, numel = 64, 1 << 20
    t0 = time.perf_counter()
    out = sc.launch(functools.partial(_big_ring, numel=numel), n)
    wall = time.perf_counter() - t0
    print(f"\nSimFabric ring allreduce, 64 workers x 1M float32: {wall:.2f} s wall, "
          f"{max(o[2] for o in out) * 1e3:.3f} ms modelled")
    want = n * (n - 1) / 2
    assert all(o[0] == want and o[1] == want for o in out)
    assert wall < 20
