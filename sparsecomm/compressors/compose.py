"""Operators built from two others: composition and the induced compressor.

``compose`` (Horvath et al., NC paper, Thm 5): ``C(x) = second(first(x))`` for two unbiased operators,
omega = (w1 + 1)(w2 + 1) - 1 (``theory.compressors.compose_omega``). ``second`` acts on the values
``first`` transmits: the k values of rand-k / top-k, the d values of a dense payload (for a
``quantized`` first stage, on its decompressed d-vector). So ``compose(randk, natural)`` sends k
natural-compressed values at shared-seed positions (bits = 9k) and w2 is taken at the length of that
value vector. The payload keeps ``first``'s kind (its indices), its values being ``second``'s
decompressed output; wire bits = ``first``'s index bits + ``second``'s payload bits.

``induced`` (Horvath & Richtarik, "A better alternative to error feedback for communication-efficient
distributed learning", ICLR 2021, arXiv 2006.11077): ``C(x) = C1(x) + C2(x - C1(x))`` with C1 a
deterministic contractive operator (top-k) and C2 unbiased: C is unbiased with
omega = w2(d) (1 - delta1(d)) (``theory.compressors.induced_omega``). The payload is ``sparse`` (the two
index sets concatenated; ``to_dense`` sums duplicates) when both parts are index-based, else
``dense``; wire bits = C1's bits + C2's bits, C2's indices charged as explicit indices in a ``sparse``
merge (``theory.compressors.index_bits``).

Both take ``first`` and ``second`` as registered names or Compressor instances. Extra keywords go to
whichever named part accepts them (``get("compose", first="randk", second="natural", ratio=0.01)``;
``get("induced", first="topk", second="randk", ratio=0.01)`` gives both parts ratio 0.01);
``first_kw`` / ``second_kw`` dicts set one part only.

Randomness: both stages draw from the one generator handed to ``compress``. With a shared-seed
generator (rand-k inside), the second stage's draws are then common to all workers too: each
worker's message is still unbiased with the declared omega, but the workers' errors are correlated.
"""

from __future__ import annotations

import torch

from sparsecomm.theory import compressors as th

from ._registry import registry
from ._common import CompressorConfigError, cpu_empty, flat_input, make_payload
from .base import Compressor

_INDEXED = ("aligned", "sparse")


def _build(part, name: str, kw: dict) -> Compressor:
    if isinstance(part, Compressor):
        if kw:
            raise CompressorConfigError(f"{name} is an already-built {part!r}; it takes no keywords {sorted(kw)}")
        return part
    if not isinstance(part, str):
        raise CompressorConfigError(f"{name} must be a registered name or a Compressor, got {part!r}")
    return registry.get(part, **kw)


def _route(who: str, first, second, first_kw, second_kw, shared: dict) -> tuple[Compressor, Compressor]:
    kw1, kw2 = dict(first_kw or {}), dict(second_kw or {})
    acc1 = registry.parameters(first) if isinstance(first, str) else []
    acc2 = registry.parameters(second) if isinstance(second, str) else []
    for key, value in shared.items():
        hit = False
        for acc, kw in ((acc1, kw1), (acc2, kw2)):
            if acc is None or key in acc:
                kw.setdefault(key, value)
                hit = True
        if not hit:
            raise CompressorConfigError(
                f"{who}: neither {first!r} nor {second!r} takes the keyword {key!r}")
    return _build(first, "first", kw1), _build(second, "second", kw2)


def _values_len(c: Compressor, d: int) -> int:
    f = getattr(c, "values_len", None)
    return f(d) if f is not None else d


def _index_wire(p) -> int:
    return int(p.meta.get("wire_bits", {}).get("indices", 0))


class Composed(Compressor):
    """second(first(x)) for two unbiased operators; see the module docstring."""

    name = "compose"
    unbiased = True

    def __init__(self, first: Compressor, second: Compressor):
        for part, label in ((first, "first"), (second, "second")):
            if not part.unbiased:
                raise CompressorConfigError(
                    f"compose needs two unbiased compressors, but {label}={part!r} is biased; "
                    f"to make a biased operator unbiased use 'induced' (C1(x) + C2(x - C1(x)))")
        self.first, self.second = first, second
        self.payload_kind = first.payload_kind if first.payload_kind != "quantized" else second.payload_kind
        self.shared_randomness = first.shared_randomness or second.shared_randomness
        self.packed_values = first.payload_kind != "quantized" and second.packed_values

    def _inner_len(self, d: int) -> int:
        return d if self.first.payload_kind == "quantized" else _values_len(self.first, d)

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        p1 = self.first.compress(flat, generator)      # (a random part checks the generator itself)
        if p1.kind == "quantized":
            p2 = self.second.compress(p1.to_dense(), generator)
            return make_payload(p2.kind, x.shape, x.dtype, p2.values, p2.meta["wire_bits"],
                                indices=p2.indices, scale=p2.scale, bucket_size=p2.bucket_size,
                                shared_scale=p2.shared_scale, values_codec=p2.values_codec)
        p2 = self.second.compress(p1.values, generator)
        vals = self.second.decompress(p2)
        wire = {"values": p2.bits}
        if p1.kind in _INDEXED:
            wire["indices"] = _index_wire(p1)
        # a dense second stage's values travel in its own encoding (natural: sign + exponent); the
        # decompressed values of a quantized second stage are floats, which travel as they are
        codec = p2.values_codec if p2.kind == "dense" and vals.dtype == p2.values.dtype else (0, 0)
        return make_payload(p1.kind, x.shape, x.dtype, vals, wire, indices=p1.indices, values_codec=codec)

    def omega(self, d):
        return th.compose_omega(self.first.omega(d), self.second.omega(self._inner_len(d)))

    def bits(self, d, dtype=torch.float32):
        if self.first.payload_kind == "quantized":
            return self.second.bits(d, dtype)
        m = self._inner_len(d)
        idx = th.index_bits(d, m) if self.first.payload_kind == "sparse" else 0
        return self.second.bits(m, dtype) + idx

    def values_len(self, d):
        return _values_len(self.second, self._inner_len(d))

    def hyper(self):
        return {"first": self.first, "second": self.second}


class Induced(Compressor):
    """C1(x) + C2(x - C1(x)); see the module docstring."""

    name = "induced"
    unbiased = True

    def __init__(self, first: Compressor, second: Compressor):
        if first.unbiased or first.delta(100) <= 0:
            raise CompressorConfigError(
                f"induced needs a biased contractive first stage (delta > 0, e.g. topk), got {first!r}")
        if not second.unbiased:
            raise CompressorConfigError(f"induced needs an unbiased second stage, got {second!r}")
        self.first, self.second = first, second
        both_indexed = first.payload_kind in _INDEXED and second.payload_kind in _INDEXED
        self.payload_kind = "sparse" if both_indexed else "dense"
        self.shared_randomness = second.shared_randomness

    def compress(self, x, generator=None):
        flat = flat_input(x, self.name)
        d = flat.numel()
        p1 = self.first.compress(flat, generator)
        if p1.kind in _INDEXED:  # rest = x - C1(x) with one copy of x
            rest = cpu_empty(d, flat.dtype).copy_(flat) if flat.device.type == "cpu" else flat.clone()
            rest.index_add_(0, p1.indices, p1.values.to(x.dtype), alpha=-1)
        else:
            rest = flat - p1.to_dense()
        p2 = self.second.compress(rest, generator)
        if self.payload_kind == "sparse":
            idx = torch.cat([p1.indices, p2.indices])
            vals = torch.cat([p1.values.to(x.dtype), p2.values.to(x.dtype)])
            wire = {"values": p1.meta["wire_bits"]["values"] + p2.meta["wire_bits"]["values"],
                    "indices": _index_wire(p1) + th.index_bits(d, p2.indices.numel())}
            return make_payload("sparse", x.shape, x.dtype, vals, wire, indices=idx)
        vals = p2.to_dense().to(x.dtype)
        if p1.kind in _INDEXED:
            vals.index_add_(0, p1.indices, p1.values.to(x.dtype))
        else:
            vals += p1.to_dense()
        return make_payload("dense", x.shape, x.dtype, vals, {"values": p1.bits + p2.bits})

    def omega(self, d):
        return th.induced_omega(self.second.omega(d), self.first.delta(d))

    def bits(self, d, dtype=torch.float32):
        b = self.first.bits(d, dtype) + self.second.bits(d, dtype)
        if self.payload_kind == "sparse" and self.second.payload_kind == "aligned":
            b += th.index_bits(d, _values_len(self.second, d))
        return b

    def values_len(self, d):
        return _values_len(self.first, d) + _values_len(self.second, d)

    def hyper(self):
        return {"first": self.first, "second": self.second}


def compose(first, second, *, first_kw=None, second_kw=None, **kw) -> Composed:
    """``second(first(x))`` by name (the catalog's ``"compose"``): ``first``/``second`` are names or
    Compressors, further keywords go to the named parts (see module docstring). The typed factory is
    :func:`sparsecomm.compressors.compose`."""
    c1, c2 = _route("compose", first, second, first_kw, second_kw, kw)
    return Composed(c1, c2)


def induced(first, second, *, first_kw=None, second_kw=None, **kw) -> Induced:
    """``first(x) + second(x - first(x))`` by name (the catalog's ``"induced"``; see module docstring).
    The typed factory is :func:`sparsecomm.compressors.induced`."""
    c1, c2 = _route("induced", first, second, first_kw, second_kw, kw)
    return Induced(c1, c2)
