"""Fault suite, in-process part (SimFabric threads and unit checks): overflow, NaN/Inf, dtype of the result,
mismatches of negotiated fields, malformed headers and forged packets, the safe result encoding.

Every check runs on every worker and asserts the same error class there; the real-process faults (kill -9,
a corrupting gloo peer, the address-space cap) are in ``test_faults_gloo.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import sparsecomm as sc
import sparsecomm.transports  # noqa: F401
from sparsecomm.errors import (IncompatibleError, MalformedMessage, MismatchError, NonFiniteError,
                               OverflowError_, SparseCommError)
from sparsecomm.payload import Payload

from tests._faults_common import CorruptingFabric, outcome, switch_corruption

#: Modelled seconds within which a detected fault stops a small call: far below any retransmission
#: timeout, so a fault that was retried or waited out instead of detected fails the bound.
AT_ONCE_S = 1e-3


def _modelled(ctx, call):
    """:func:`outcome` of ``call()`` with the modelled seconds it took on this worker in place of the wall
    time (a SimFabric wait costs modelled time, not wall time)."""
    t0 = ctx.fabric.now()
    name, msg, _ = outcome(call)
    return name, msg, ctx.fabric.now() - t0

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIM = ("ring", "allgather", "omnireduce", "switch")
REPO = Path(__file__).resolve().parents[2]


def _same_error_everywhere(results, cls: type, *needles: str):
    names = [r[0] for r in results]
    assert names == [cls.__name__] * len(results), results
    for r in results:
        for nd in needles:
            assert nd in r[1], (nd, r[1])


# ----------------------------------------------------------------------------- integers
@pytest.mark.parametrize("name", ["ring", "allgather", "omnireduce"])
def test_int32_sums_are_exact_in_the_input_dtype_or_raise_overflow_on_every_worker(name):
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric)
        over = outcome(lambda: t.allreduce(torch.full((8,), 2**30, dtype=torch.int32)))
        # large magnitudes whose sum fits: summed wider, returned exactly as int32
        v = [2**30, 2**30, -(2**30) - 5][ctx.rank]
        y = t.allreduce(torch.full((8,), v, dtype=torch.int32))
        small = t.allreduce(torch.arange(8, dtype=torch.int16) * (ctx.rank + 1))
        return over, y, small
    out = sc.launch(fn, 3)
    _same_error_everywhere([o[0] for o in out], OverflowError_, "int32")
    for _, y, small in out:
        assert y.dtype == torch.int32 and torch.equal(y, torch.full((8,), 2**30 - 5, dtype=torch.int32))
        assert small.dtype == torch.int16 and torch.equal(small, torch.arange(8, dtype=torch.int16) * 6)


def test_switch_int_sums_that_could_overflow_raise_before_sending():
    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4)
        return outcome(lambda: t.allreduce(torch.full((8,), 2**30, dtype=torch.int32)))
    _same_error_everywhere(sc.launch(fn, 3), OverflowError_)


# ----------------------------------------------------------------------------- floats
@pytest.mark.parametrize("name", ["ring", "allgather", "omnireduce", "switch", "sparse-switch"])
def test_fp16_overflow_to_inf_is_an_overflow_error_on_every_worker(name):
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric)
        err = outcome(lambda: t.allreduce(torch.full((16,), 30000.0, dtype=torch.float16)))
        return err, t.allreduce(torch.full((16,), 20000.0, dtype=torch.float16) * (ctx.rank == 0))   # still usable
    out = sc.launch(fn, 3)
    _same_error_everywhere([o[0] for o in out], OverflowError_, "float16")
    assert all(y.dtype == torch.float16 and torch.equal(y, torch.full((16,), 20000.0, dtype=torch.float16))
               for _, y in out)


@pytest.mark.parametrize("name", ["switch", "sparse-switch"])
def test_the_switches_refuse_to_zero_the_values_around_a_huge_one(name):
    """1e30 among 1e-3: the fixed-point quantum of the block (the sparse switch: of the job) would round
    every 1e-3 to 0; both switches raise instead, on every worker, and stay usable."""
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric, pool_size=4)
        x = torch.full((512,), 1e-3)
        if ctx.rank == 1:
            x[5] = 1e30
        err = outcome(lambda: t.allreduce(x))
        return err, t.allreduce(torch.full((512,), 1e-3))
    out = sc.launch(fn, 3)
    _same_error_everywhere([o[0] for o in out], OverflowError_, "max_exponent")
    assert all(torch.allclose(y, torch.full((512,), 3e-3), rtol=1e-6) for _, y in out)


@pytest.mark.parametrize("name", SIM)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_input_raises_on_every_worker_naming_the_worker(name, bad):
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric)
        x = torch.ones(100)
        if ctx.rank == 2:
            x[37] = float(bad)
        err = outcome(lambda: t.allreduce(x))
        return err, t.allreduce(torch.ones(100))   # the transport stays usable
    out = sc.launch(fn, 3)
    needles = ("worker 2",) if name != "switch" else ()
    _same_error_everywhere([o[0] for o in out], NonFiniteError, *needles)
    assert all(torch.allclose(y, torch.full((100,), 3.0)) for _, y in out)


@pytest.mark.parametrize("name", ["ring", "allgather", "omnireduce"])
def test_nonfinite_pass_sums_them_through(name):
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric, nonfinite="pass")
        x = torch.ones(64)
        if ctx.rank == 0:
            x[3] = float("nan")
        x[9] = float("inf")
        return t.allreduce(x)
    for y in sc.launch(fn, 2):
        assert torch.isnan(y[3]) and y[9] == float("inf") and y[0] == 2.0


def test_nonfinite_option_is_validated_and_the_switch_cannot_pass_them():
    def fn(ctx):
        errs = []
        for name in ("ring", "allgather", "omnireduce"):
            errs.append(outcome(lambda: sc.transports.get(name, ctx.fabric, nonfinite="ignore"))[0])
        errs.append(outcome(lambda: sc.transports.get("switch", ctx.fabric, nonfinite="pass"))[0])
        return errs
    assert sc.launch(fn, 2) == [["InvalidValueError"] * 3 + ["IncompatibleError"]] * 2   # a ValueError too
    assert issubclass(IncompatibleError, SparseCommError)


# ----------------------------------------------------------------------------- negotiated fields
def _aligned(rank, shift=0):
    return Payload("aligned", torch.ones(4), torch.Size([8]), torch.float32, indices=torch.arange(4) + shift)


MISMATCHES = {
    "length": lambda r: torch.ones(10 + (r == 2)),
    "dtype": lambda r: torch.ones(10, dtype=torch.float64 if r == 2 else torch.float32),
    "kind": lambda r: _aligned(r) if r == 2 else torch.ones(8),
    "indices": lambda r: _aligned(r, shift=int(r == 2)),
}


@pytest.mark.parametrize("name", ["ring", "allgather", "omnireduce", "switch"])
def test_every_negotiated_field_mismatch_is_a_mismatch_error_on_every_worker(name):
    def fn(ctx):
        t = sc.transports.get(name, ctx.fabric)
        res = {k: outcome(lambda: t.allreduce(mk(ctx.rank))) for k, mk in MISMATCHES.items()}
        return res, t.allreduce(torch.ones(12))
    out = sc.launch(fn, 3)
    for case in MISMATCHES:
        _same_error_everywhere([o[0][case] for o in out], MismatchError)
    assert all(torch.equal(y, torch.full((12,), 3.0)) for _, y in out)


def test_workers_running_different_transports_get_a_mismatch_error_naming_both():
    def fn(ctx):
        name = "allgather" if ctx.rank == 1 else "ring"
        return _modelled(ctx, lambda: sc.transports.get(name, ctx.fabric).allreduce(torch.ones(16)))
    out = sc.launch(fn, 3, timeout_s=30)
    _same_error_everywhere(out, MismatchError, "transport")
    assert all(o[2] < AT_ONCE_S for o in out), [o[2] for o in out]
    assert any("'ring'" in o[1] and "'allgather'" in o[1] for o in out), out


# ----------------------------------------------------------------------------- malformed / forged
def test_a_corrupted_agreement_header_is_malformed_on_every_worker():
    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 1:
            from sparsecomm.transports._handshake import HANDSHAKE_TAG

            def rw(t, dst, tag):
                if tag == HANDSHAKE_TAG:
                    out = t.detach().clone()
                    out[5] += 7          # a field rewritten on the wire, checksum left as it was
                    return out
            f = CorruptingFabric(f, rw)
        return outcome(lambda: sc.transports.get("ring", f).allreduce(torch.ones(16)))
    out = sc.launch(fn, 3, timeout_s=30)
    # the honest workers both receive a corrupted header; the liar (rank 1) is left waiting, and the
    # SimFabric reports that deadlock at once (on gloo it gets the failure record: test_faults_gloo)
    assert [out[0][0], out[2][0]] == ["MalformedMessage"] * 2, out
    assert "worker 1" in out[0][1] and out[1][0] in ("FabricTimeout", "PeerFailure", "MalformedMessage"), out


def test_allgather_bounds_every_announced_length_by_the_tensor_before_allocating():
    """A peer announcing 2^40 values (checksum recomputed: a lying peer, not line noise) is rejected
    before anything is allocated from its header: MalformedMessage on every worker."""
    from sparsecomm.transports._handshake import HANDSHAKE_TAG, _PRE, _checksum

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 0:
            def rw(t, dst, tag):
                if tag == HANDSHAKE_TAG:
                    out = t.detach().clone()
                    out[_PRE + 6] = 2**40      # values count
                    out[-1] = _checksum(out)
                    return out
            f = CorruptingFabric(f, rw)
        return outcome(lambda: sc.transports.get("allgather", f).allreduce(
            Payload("sparse", torch.ones(3), torch.Size([64]), torch.float32, indices=torch.arange(3))))
    out = sc.launch(fn, 3, timeout_s=30)
    assert [o[0] for o in out[1:]] == ["MalformedMessage"] * 2, out
    assert "2^40" not in out[1][1] and str(2**40) in out[1][1]


@pytest.mark.parametrize("field, value", [("F_AGGS", 10**13), ("F_BLOCK", 0), ("F_LANES", 2**36),
                                          ("F_K0", 2**40), ("F_WORLD", 32), ("F_DTYPE", 12345)])
@pytest.mark.parametrize("deployment", ["dedicated", "colocated"])
def test_forged_omnireduce_headers_are_rejected_by_the_aggregators(field, value, deployment):
    from sparsecomm.transports.omnireduce import wire

    idx = getattr(wire, field)

    def fn(ctx):
        f = ctx.fabric
        if ctx.rank == 1:
            def rw(t, dst, tag):
                if tag == wire.TAG_HDR_UP:
                    out = t.detach().clone()
                    out.view(torch.int64)[idx] = value
                    return out
            f = CorruptingFabric(f, rw)
        t = sc.transports.get("omnireduce", f, block_size=16, lanes=4, deployment=deployment)
        return _modelled(ctx, lambda: t.allreduce(torch.ones(100)))
    out = sc.launch(fn, 3, timeout_s=30)
    _same_error_everywhere(out, MalformedMessage, "worker 1")
    assert all(o[2] < AT_ONCE_S for o in out), [o[2] for o in out]


def test_the_switch_drops_packets_claiming_another_worker_count():
    from sparsecomm.transports.switchml import dataplane as dp

    d = dp.Dataplane(dp.SwitchConfig(elems=64))
    d.world = 3
    row = np.zeros((2, dp.HEADER + 64), dtype=np.int32)
    row[:, dp.F_TYPE] = dp.T_DATA
    row[:, dp.F_SLOT] = [1, 2]
    row[:, dp.F_NW] = 32                  # forged: 32 workers
    row[:, dp.F_WORKER] = 31
    mc, uc = d.process(row)
    assert len(mc) == 0 and len(uc) == 0 and d.stats["malformed"] == 2
    assert not d.seen.any()


def test_a_forged_packet_is_dropped_and_reported_to_every_worker():
    """The switch cannot tell a forged extra packet from a corrupted one a job needs (which would leave
    every worker waiting for its slot): it drops it and tells every worker, naming the sender's port."""
    from sparsecomm.transports.switchml import dataplane as dp

    def fn(ctx):
        t = sc.transports.get("switch", ctx.fabric, pool_size=4)
        if ctx.rank == 0:
            row = torch.zeros((1, dp.HEADER + 64), dtype=torch.int32)
            row[0, dp.F_TYPE], row[0, dp.F_SLOT], row[0, dp.F_NW], row[0, dp.F_WORKER] = dp.T_DATA, 3, 32, 31
            ctx.fabric.send(row, t.switch, dp.TAG_UP)
        return _modelled(ctx, lambda: t.allreduce(torch.ones(200) * (ctx.rank + 1)))
    out = sc.launch(fn, 3, timeout_s=30)
    _same_error_everywhere(out, MalformedMessage, "worker 0")
    assert all(o[2] < AT_ONCE_S for o in out), [o[2] for o in out]


@pytest.mark.parametrize("name, words", [("switch", 1), ("switch", 8), ("sparse-switch", 2), ("sparse-switch", 4)])
def test_a_peer_whose_switch_packets_are_corrupted_stops_every_worker_at_once(name, words):
    def fn(ctx):
        f = CorruptingFabric(ctx.fabric, switch_corruption(words)) if ctx.rank == 1 else ctx.fabric
        t = sc.transports.get(name, f, pool_size=4)
        return _modelled(ctx, lambda: t.allreduce(torch.ones(1000) * (ctx.rank + 1)))
    out = sc.launch(fn, 3, timeout_s=30)
    _same_error_everywhere(out, MalformedMessage, "worker 1", "cannot parse")
    assert all(o[2] < AT_ONCE_S for o in out), [o[2] for o in out]


# ----------------------------------------------------------------------------- no pickle from peers
def test_nothing_received_from_a_peer_is_unpickled():
    """Source audit: no object collectives, no pickle.loads outside the spawning parent's own pipe."""
    offenders = []
    for path in (REPO / "sparsecomm").rglob("*.py"):
        text = path.read_text()
        if re.search(r"_object\(|_object_list\(|recv_object|broadcast_object", text):
            offenders.append(str(path))
        if "pickle.loads" in text and path.name not in ("torch_backend.py", "supervise.py"):
            offenders.append(str(path))
    assert offenders == []
    src = "".join((REPO / "sparsecomm" / "launch" / f).read_text() for f in ("torch_backend.py", "supervise.py"))
    # in the gloo launcher, pickle.loads reads only what a spawned child sends its own parent
    # (fn from the parent, a self-check of an error before it is sent, the parent reading its children)
    assert src.count("pickle.loads") == 4 and "all_gather_object" not in src


class _Evil:
    def __reduce__(self):
        return (exec, ("import os; os._exit(3)",))


def test_the_safe_result_encoding_round_trips_and_refuses_anything_else():
    from sparsecomm.launch.results import decode_result, encode_result

    obj = {"a": [1, 2.5, None, True, "x", b"\x00\xff"], 3: (torch.arange(6).reshape(2, 3),
           torch.tensor([1.5], dtype=torch.bfloat16)), "big": 2**80}
    back = decode_result(encode_result(obj))
    assert back["a"] == obj["a"] and back["big"] == 2**80
    assert torch.equal(back[3][0], obj[3][0]) and back[3][1].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="safe encoding"):
        encode_result(_Evil())
    data = bytearray(encode_result([torch.ones(4)]))
    data[8:] = data[8:].replace(b"16]", b"1600000000000]")   # a tensor claiming more bytes than sent
    with pytest.raises(MalformedMessage):
        decode_result(bytes(data))
    with pytest.raises(MalformedMessage):
        decode_result(b"\xff" * 8 + b"{}")


def _result_message(doc, blob: bytes = b"") -> bytes:
    """A message in the safe result encoding with a hand-written JSON document (a crafted header)."""
    import json

    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return len(text).to_bytes(8, "little") + text + blob


CRAFTED_RESULTS = {
    "100000 dims": (["T", "torch.float32", [1] * 100_000, 0, 4], bytes(4)),
    "65 dims": (["T", "torch.float32", [1] * 65, 0, 4], bytes(4)),
    "65 numpy dims": (["A", "<f4", [1] * 65, 0, 4], bytes(4)),
    "huge factors": (["T", "torch.float32", [10**4000] * 200, 0, 4], bytes(4)),
    "dim past int64": (["T", "torch.float32", [0, 10**30], 0, 0], b""),
    "negative dims": (["T", "torch.float32", [-1, -4], 0, 4], bytes(4)),
    "bool dim": (["T", "torch.float32", [True, 4], 0, 16], bytes(16)),
    "more than sent": (["T", "torch.float32", [2**40], 0, 2**42], bytes(16)),
    "shared bytes": (["l", [["T", "torch.uint8", [16], 0, 16]] * 1000], bytes(16)),
    "out of order": (["l", [["T", "torch.uint8", [8], 8, 8], ["T", "torch.uint8", [8], 0, 8]]], bytes(16)),
    "unclaimed bytes": (["T", "torch.uint8", [8], 0, 8], bytes(16)),
    "numpy objects": (["A", "|O", [1], 0, 8], bytes(8)),
    "big endian": (["A", ">f8", [1], 0, 8], bytes(8)),
    "short scalar": (["a", "<f8", 0, 4], bytes(4)),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, b""),
    "too many lists": (b'["l", [' + b'["n"],' * (1 << 21) + b'["n"]]]', b""),
    "list of a string": (["l", ["n"]], b""),
    "bool of a list": (["b", [1]], b""),
    "none with data": (["n", 1], b""),
    "long int": (["i", "9" * 5000], b""),
    "long float": (["f", "1" * 100_000], b""),
    "odd hex": (["y", "abc"], b""),
    "dict entry": (["d", [["n"]]], b""),
    "unhashable key": (["d", [[["l", []], ["n"]]]], b""),
    "string of an int": (["s", 3], b""),
    "object": ({"T": 1}, b""),
    "offset as text": (["T", "torch.float32", [1], "0", 4], bytes(4)),
}


@pytest.mark.parametrize("case", list(CRAFTED_RESULTS))
def test_a_crafted_result_header_is_malformed_at_once(case):
    """Every size, count, depth, dimension and offset a peer writes into a result (launch under
    torchrun) is checked before anything is allocated from it or recursed into: MalformedMessage,
    at once, never a RecursionError or an allocation sized by the header."""
    import time

    from sparsecomm.launch.results import decode_result

    data = _result_message(*CRAFTED_RESULTS[case])
    t0 = time.monotonic()
    with pytest.raises(MalformedMessage):
        decode_result(data)
    assert time.monotonic() - t0 < 1.0


def test_numeric_numpy_results_cross_ranks_as_plain_data():
    """numpy arrays and scalars of numeric dtypes travel like tensors (dtype, shape, bytes): the same
    values, dtype and shape come back; object arrays are refused; numpy strings stay strings."""
    from sparsecomm.errors import InvalidTypeError, InvalidValueError
    from sparsecomm.launch.results import decode_result, encode_result

    arrays = [(np.arange(12) % 5).astype(dt).reshape(3, 4) for dt in
              (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
               np.float16, np.float32, np.float64, np.complex64, np.complex128)]
    arrays += [np.arange(6, dtype=">f8")[::2], np.zeros((0, 5)), np.array(3.5), np.packbits([1, 0, 1])]
    scalars = [np.float32(1.25), np.float64(-2.5), np.int64(2**62), np.bool_(True), np.uint8(7)]
    back = decode_result(encode_result({"a": arrays, "s": scalars, "t": torch.ones(2), "u": np.str_("x")}))
    for a, b in zip(arrays, back["a"]):
        assert type(b) is np.ndarray and b.shape == a.shape and b.dtype == a.dtype.newbyteorder("=")
        assert np.array_equal(a, b) and b.flags.writeable
    assert [(type(v), v) for v in back["s"]] == [(type(v), v) for v in scalars]
    assert torch.equal(back["t"], torch.ones(2)) and back["u"] == "x"
    with pytest.raises(InvalidTypeError, match="dtype object"):
        encode_result(np.array([1, "a"], dtype=object))
    with pytest.raises(InvalidValueError, match="dimensions"):
        encode_result(torch.zeros([1] * 65))


def test_the_cost_model_books_the_fixed_size_handshake():
    from sparsecomm.transports._handshake import HEADER_BYTES, handshake_bytes
    from theory import costs

    assert costs.HANDSHAKE_BYTES == HEADER_BYTES == handshake_bytes(3) == handshake_bytes(12)
    assert costs.ALLGATHER_HEADER_BYTES == HEADER_BYTES


@pytest.mark.parametrize("compressor", ["fp16", "bf16", "identity"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_gradient_through_a_checking_compressor_is_an_error_on_every_worker(compressor, bad):
    """Method ``none`` around a compressor that checks its own input (``checks_finite``): its
    NonFiniteError on one worker stands for the pipeline's own check, which that worker then answers by
    sending zeros poisoned with NaN, so every worker raises. An ``ef`` round (which has state) keeps the
    pipeline's own check."""
    def fn(ctx):
        out = {}
        for name, method in (("none", "none"), ("ef", "ef")):
            with ctx.seeded(0):
                model = torch.nn.Linear(16, 4)
            opt = sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), compressor=compressor,
                                          method=method, transport="ring", verify_replicas_every=0)
            x = torch.ones(8, 16)
            if ctx.rank == 1:
                x[0, 3] = float(bad)
            opt.zero_grad()
            model(x).sum().backward()
            out[name] = outcome(opt.step)
        return out
    res = sc.launch(fn, 3)
    for name in ("none", "ef"):
        _same_error_everywhere([r[name] for r in res], NonFiniteError)
