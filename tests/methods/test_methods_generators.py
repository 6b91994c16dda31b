"""A method's checkpoint carries its compressor's own generators.

A compressor built with ``seed=`` and called without a generator draws from a generator of its own
(sparsecomm/compressors/_common.py); that generator is part of the run's state. Resuming from
``Method.state_dict()`` into a fresh method with a fresh compressor must continue bit for bit, and the
test shows that without the saved generator state the continuation differs.
"""

from __future__ import annotations

import io

import pytest
import torch

import sparsecomm as sc

D = 200


def _grads(t: int) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(1000 + t), dtype=torch.float64)


def _rounds(method, t0: int, t1: int):
    """Payload values (and indices) and estimates of rounds t0..t1-1, one worker, generator=None."""
    out = []
    for t in range(t0, t1):
        p = method.encode(_grads(t), 0)
        est = method.decode(p.to_dense().reshape(-1), 1, 0)
        out.append((p.values.clone(), None if p.indices is None else p.indices.clone(), est.clone()))
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[2], y[2])
               and (x[1] is None) == (y[1] is None) and (x[1] is None or torch.equal(x[1], y[1]))
               for x, y in zip(a, b))


@pytest.mark.parametrize("method,cname,hyper", [("none", "randk", {"k": 7}), ("diana", "randk", {"k": 7}),
                                                ("ef21", "randk", {"k": 7}), ("diana", "qsgd", {"levels": 4})])
def test_resume_is_bit_identical_with_a_private_generator(method, cname, hyper):
    make = lambda: sc.methods.get(method, compressor=sc.compressors.get(cname, seed=11, **hyper))  # noqa: E731
    m = make()
    _rounds(m, 0, 4)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)                    # through torch.save, as a checkpoint would
    buf.seek(0)
    sd = torch.load(buf)
    assert "cpu" in sd["compressor_generators"]
    cont = _rounds(m, 4, 9)

    fresh = make()
    fresh.load_state_dict(sd)
    assert _same(cont, _rounds(fresh, 4, 9))

    # the generator state is what makes it identical: without it the continuation draws other coordinates
    blind = make()
    blind.load_state_dict({k: v for k, v in sd.items() if k != "compressor_generators"})
    assert not _same(cont, _rounds(blind, 4, 9))
