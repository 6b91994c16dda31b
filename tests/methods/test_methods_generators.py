"""A method's checkpoint is its states; the randomness is the caller's generator.

A compressor holds no generator of its own (sparsecomm/compressors/_common.py): the caller passes one
to every ``encode``. Resuming from the saved states and the saved generator state into a fresh method
with a fresh compressor continues bit for bit; the saved states carry nothing of the compressor, and
without the generator state the continuation differs.
"""

from __future__ import annotations

import io

import pytest
import torch

import sparsecomm as sc
from sparsecomm.methods.state import states_from_dict, states_to_dict

D = 200


def _grads(t: int) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(1000 + t), dtype=torch.float64)


def _rounds(method, st, gen, t0: int, t1: int):
    """Payload values (and indices) and estimates of rounds t0..t1-1, one worker."""
    out = []
    for t in range(t0, t1):
        p, st = method.encode(_grads(t), st, gen)
        est, st = method.decode(p.to_dense().reshape(-1), 1, st)
        out.append((p.values.clone(), None if p.indices is None else p.indices.clone(), est.clone()))
    return out, st


def _same(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[2], y[2])
               and (x[1] is None) == (y[1] is None) and (x[1] is None or torch.equal(x[1], y[1]))
               for x, y in zip(a, b))


@pytest.mark.parametrize("method,cname,hyper", [("none", "randk", {"k": 7}), ("diana", "randk", {"k": 7}),
                                                ("ef21", "randk", {"k": 7}), ("diana", "qsgd", {"levels": 4})])
def test_resume_is_bit_identical_from_the_states_and_the_generator(method, cname, hyper):
    make = lambda: sc.methods.get(method, compressor=sc.compressors.get(cname, **hyper))  # noqa: E731
    m = make()
    gen = torch.Generator().manual_seed(11)
    _, st = _rounds(m, m.init(D, torch.float64), gen, 0, 4)
    buf = io.BytesIO()
    torch.save({"states": states_to_dict(m, {0: st}), "generator": gen.get_state()}, buf)
    buf.seek(0)
    sd = torch.load(buf)                                # through torch.save, as a checkpoint would
    assert set(sd["states"]) == {"method", "buckets"}  # nothing of the compressor
    cont, _ = _rounds(m, st, gen, 4, 9)

    fresh = make()
    g2 = torch.Generator()
    g2.set_state(sd["generator"])
    again, _ = _rounds(fresh, states_from_dict(fresh, sd["states"])[0], g2, 4, 9)
    assert _same(cont, again)

    # the generator state is what makes it identical: another one draws other coordinates
    blind, _ = _rounds(make(), states_from_dict(fresh, sd["states"])[0], torch.Generator().manual_seed(11), 4, 9)
    assert not _same(cont, blind)
