"""Gradient -> bucket, the first stage of a step's data path: the optimizer's parameters laid out
into flat buckets (one dtype/device each, at most ``bucket_cap_mb``), each parameter's gradient copied
into its slice (:meth:`Bucket.gather`) and, after the round, ``p.grad`` made a view of the bucket's
averaged estimate (:meth:`Bucket.scatter`); a row-sparse gradient is
scattered into its rows and comes back as sparse rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    key: int
    params: list[torch.nn.Parameter]
    dtype: torch.dtype
    device: torch.device
    compress: bool
    numel: int = 0
    offsets: list[int] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    sparse: bool = False        # one parameter with a sparse gradient, carried as a sparse payload
    ready: int = 0              # parameters whose gradient is in (overlap)
    #: the shapes of the bucket's parameters, in their order in the flat buffer: fixed by :func:`layout` with the
    #: offsets (the same object at every step)
    shapes: tuple[torch.Size, ...] = ()

    def gather(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        buf = self.buffer
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            view = buf[off:off + n]
            g = p.grad
            if g is None:
                view.zero_()
            elif g.is_sparse:
                g = g.coalesce()
                view.zero_()
                rows = view.view(p.shape)
                rows.index_put_((g.indices()[0],), g.values().to(self.dtype), accumulate=True)
            else:
                view.copy_(g.reshape(-1))
        return buf

    def scatter(self, est: torch.Tensor, sparse_ids: frozenset[int] = frozenset()) -> None:
        """``p.grad`` becomes a view of ``est`` (a fresh tensor every step: no copy), as DDP's
        ``gradient_as_bucket_view``; a parameter whose gradient is sparse gets the non-zero rows."""
        same = est.dtype == self.dtype and est.device == self.device
        for p, off in zip(self.params, self.offsets):
            n = p.numel()
            v = est[off:off + n].view_as(p)
            v = v if same else v.to(device=p.device, dtype=p.dtype)
            p.grad = dense_to_sparse_rows(v) if id(p) in sparse_ids else v


def dense_to_sparse_rows(dense: torch.Tensor) -> torch.Tensor:
    """A coalesced sparse COO tensor holding the rows of ``dense`` that are not all zero (a NaN row
    counts as non-zero)."""
    if dense.dim() == 0:
        return dense
    rows_view = dense.reshape(dense.shape[0], -1)
    keep = rows_view.ne(0).any(dim=1).nonzero().flatten()
    return torch.sparse_coo_tensor(keep[None], dense[keep], dense.shape, is_coalesced=True,
                                   check_invariants=False)


def layout(params: list[torch.nn.Parameter], cap_bytes: int, min_compress_size: int,
            sparse_ids: frozenset[int] = frozenset()) -> list[Bucket]:
    buckets: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    for p in params:
        if id(p) in sparse_ids:
            b = Bucket(len(buckets), [p], p.dtype, p.device, p.numel() >= min_compress_size, p.numel(),
                        [0], sparse=True)
            buckets.append(b)
            continue
        compress = p.numel() >= min_compress_size
        sig = (p.dtype, p.device, compress)
        b = open_.get(sig)
        nbytes = p.numel() * p.element_size()
        if b is not None and b.numel and (b.numel * p.element_size() + nbytes) > cap_bytes:
            b = None
        if b is None:
            b = Bucket(len(buckets), [], p.dtype, p.device, compress)
            buckets.append(b)
            open_[sig] = b
        b.offsets.append(b.numel)
        b.params.append(p)
        b.numel += p.numel()
    for b in buckets:
        b.shapes = tuple(p.shape for p in b.params)
    return buckets
