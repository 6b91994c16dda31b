"""The DDP comm hook (sparsecomm.ddp) under stock DistributedDataParallel on 2 gloo processes."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from torch import nn

import sparsecomm as sc

from . import _train_common as tc

STEPS = 5
SMALL_CAP = 300 / 2 ** 20          # several DDP buckets for the MLP


def _run(ctx, mode: str, steps: int, **hook):
    from sparsecomm import ddp as scddp

    model = tc.MLP(0, with_unused=False)
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=SMALL_CAP)
    state = scddp.register(net, **hook) if mode == "hook" else None
    opt = tc.make_inner(net)
    for t in range(steps):
        opt.zero_grad()
        x, y = tc.batch(ctx.rank, t)
        tc.loss_fn(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], state


def _worker(ctx, steps: int, compressed: dict):
    out = {}
    out["builtin"], _ = _run(ctx, "builtin", steps)
    out["hook"], state = _run(ctx, "hook", steps, compressor="none")
    out["iter"] = state.iter
    out["transport"] = state.pipeline.transport.name
    # a compressed method under DDP: every rank ends with the same parameters; the state pickles
    # without its process group and comes back bound to the default group with the same state
    out["ef"], st = _run(ctx, "hook", steps, **compressed)
    blob = pickle.dumps(st)
    back = pickle.loads(blob)
    out["pickle_has_pg"] = b"ProcessGroup" in blob or b"Fabric" in blob
    sd, sd2 = st.state_dict(), back.state_dict()
    out["roundtrip"] = (sd["iter"] == sd2["iter"] and
                        all(torch.equal(a.error, back.pipeline.method.state(k).error)
                            for k, a in ((k, st.pipeline.method.state(k)) for k in st.pipeline.method.keys())))
    out["keys"] = sorted(st.pipeline.method.keys())
    out["stats"] = st.compression_stats()
    return out


@pytest.mark.multiprocess
def test_hook_equals_builtin_allreduce_gloo():
    have = sc.transports.available()
    carrier = next((n for n in ("allgather", "omnireduce") if n in have), None)
    assert carrier is not None, "a transport that carries sparse payloads"
    compressed = dict(compressor="topk", method="ef", ratio=0.3, transport=carrier)
    res = sc.launch(functools.partial(_worker, steps=STEPS, compressed=compressed), world_size=2,
                    backend="gloo")
    ref = tc.reference(2, STEPS, with_unused=False)
    for r in res:
        for a, b, c in zip(r["builtin"], r["hook"], ref):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
            torch.testing.assert_close(b, c, rtol=0, atol=1e-6)
        assert r["iter"] == STEPS
        assert not r["pickle_has_pg"] and r["roundtrip"]
        assert r["keys"] and all(str(k).startswith("p:") for k in r["keys"])   # keyed by parameters
        assert r["stats"]["ratio"] > 1
    for a, b in zip(res[0]["ef"], res[1]["ef"]):
        assert torch.equal(a, b)
    # the compressed run really differs from the uncompressed one
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(res[0]["ef"], res[0]["hook"]))
