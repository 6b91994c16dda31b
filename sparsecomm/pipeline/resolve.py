"""Names -> the transport of a pipeline and the checks of its method: the ``transport=`` rule of
:class:`~sparsecomm.optim.DistributedOptimizer` and the DDP hook (a catalog name, ``"default"``, ``"auto"``,
or an object; :func:`check_pair`: it carries the method's payloads), the fabric by default, and the warning for
a method x compressor pair with no guarantee. (The method comes from :func:`sparsecomm.methods.build`.)

``"default"`` (the frontends' default) is the payload kind's default transport (:func:`_default_transport`),
one for the whole model, fixed at construction (the same bits run after run). ``"auto"`` resolves here to
the same transport, which carries every bucket until the per-bucket choice of
:mod:`sparsecomm.pipeline.auto` has measured them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import compressors, transports
from ..compressors.base import Compressor
from ..errors import IncompatibleError, InvalidTypeError, SparseCommError
from ..fabric.base import Fabric
from ..fabric.torch.torch_fabric import DEFAULT_TIMEOUT_S, TorchFabric
from ..launch import current_context
from ..methods import Method
from ..transports.base import Transport

AUTO_ORDER = ("ring", "omnireduce", "switch", "allgather")


def default_fabric(process_group: Any = None) -> Fabric:
    """The fabric of the current :func:`sparsecomm.launch` worker, else a TorchFabric over the default
    process group; the same for ``process_group`` ``None``, the default group or the launch's workers'
    group (``ctx.fabric.native_group``). Any other ``process_group``: a new TorchFabric over that group
    (``TorchFabric(group=process_group)``), on which every transport without services runs, its waits
    bounded by the launch's ``timeout_s`` inside :func:`sparsecomm.launch` (else TorchFabric's default;
    pass ``fabric=TorchFabric(group=pg, timeout_s=...)`` to the optimizer for another bound)."""
    ctx = current_context()
    if process_group is not None and process_group is not dist.group.WORLD and (
            ctx is None or process_group is not ctx.fabric.native_group):
        bound = ctx.fabric.timeout_s if ctx is not None else DEFAULT_TIMEOUT_S
        return TorchFabric(group=process_group, timeout_s=bound)
    if ctx is not None:
        return ctx.fabric
    if dist.is_available() and dist.is_initialized():
        return TorchFabric()
    raise SparseCommError("no fabric: call this inside sc.launch(fn, ...), pass fabric=, or initialise "
                          "torch.distributed first")


def _transport_class(name: str) -> Any:
    return transports.registry.factory(name)  # unknown names raise, listing the valid ones


def _payload_traits(comp: Compressor) -> tuple[str, bool]:
    return comp.payload_kind, comp.shared_scale


def _carried_compressors(tcls: type[Transport]) -> list[str]:
    out = []
    for n in compressors.available():
        f = compressors.registry.product(n)
        if tcls.can_carry(f.payload_kind, f.shared_scale):
            out.append(n)
    return out


def check_pair(method: Method, transport_name: str, tcls: type[Transport]) -> None:
    """Raise IncompatibleError when ``tcls`` cannot carry what ``method``'s compressor produces."""
    kind, shared = _payload_traits(method.compressor)
    if tcls.can_carry(kind, shared):
        return
    ok = [n for n in transports.available() if transports.registry.factory(n).can_carry(kind, shared)]
    scale = " with a per-worker scale" if kind == "quantized" and not shared else ""
    comp = method.compressor
    cname = comp.name or type(comp).__name__
    carried = _carried_compressors(tcls)
    raise IncompatibleError(
        f"compressor {cname!r} (method {method.name!r}) produces {kind!r} payloads{scale}, which "
        f"transport {transport_name!r} cannot carry (it carries {', '.join(sorted(tcls.carries))}). "
        f"Transports that can: {', '.join(ok) or 'none registered'}"
        + (f"; compressors {transport_name!r} carries: {', '.join(carried)}" if carried else "") + ".")


def build_transport(transport: str | Transport, method: Method, fabric: Fabric | None,
                    transport_kwargs: dict | None) -> Transport:
    """The transport (checked against the method's payload kind) on ``fabric``."""
    if isinstance(transport, Transport):
        if transport_kwargs:
            raise InvalidTypeError("transport_kwargs given with a Transport object")
        if fabric is not None and transport.fabric is not fabric:
            raise SparseCommError("fabric= differs from the fabric of the Transport object")
        check_pair(method, transport.name or type(transport).__name__, type(transport))
        return transport
    if not isinstance(transport, str):
        raise InvalidTypeError(f"transport must be a name or a Transport, got {transport!r}")
    fabric = fabric if fabric is not None else default_fabric()
    if transport in ("default", "auto"):
        transport = _default_transport(method, fabric)
    tcls = _transport_class(transport)
    check_pair(method, transport, tcls)
    kwargs = dict(transport_kwargs or {})
    if "inplace" not in kwargs and "inplace" in (transports.registry.parameters(transport) or ()):
        kwargs["inplace"] = True   # the buckets are scratch: let the transport sum into them
    return transports.get(transport, fabric, **kwargs)   # a keyword it does not take raises there


def _default_transport(method: Method, fabric: Fabric) -> str:
    """The payload kind's default transport: ``"default"``'s, and ``"auto"``'s before its per-bucket
    decisions and for the calls they do not cover (row-sparse gradients, the agreements of the
    frontends): the first of ``AUTO_ORDER`` that
    carries the payload, steered by bytes on the wire: scattered
    ``sparse`` payloads go to allgather (through omnireduce each scattered value costs a whole block of
    ``block_size`` values); payloads whose values travel packed only where no sum is formed on
    the wire (``packed_values``: natural compression, 9 of 32 bits; majority-vote signs, 1 bit against
    the ring's int8 partial sums, ``sum_bits``) go to allgather while its ``(n-1)`` packed copies cost
    less than a ring's ``2 (n-1)/n`` unpacked ones."""
    comp = method.compressor
    kind, shared = _payload_traits(comp)
    order = list(AUTO_ORDER)
    n = int(fabric.world_size)
    if kind == "sparse":
        order.remove("allgather")
        order.insert(0, "allgather")
    elif comp.packed_values and n > 1:
        probe = 1 << 20
        packed = comp.bits(probe, torch.float32) / probe
        summed = comp.sum_bits(n)    # a summing transport's unit
        if (n - 1) * packed < 2.0 * (n - 1) / n * summed:
            order.remove("allgather")
            order.insert(0, "allgather")
    if kind == "dense" and fabric.native_group is not None and order[0] != "allgather":
        order.insert(0, "native")
    for name in order:
        if name in transports.registry and _transport_class(name).can_carry(kind, shared):
            return name
    raise IncompatibleError(f"no registered transport carries {kind!r} payloads "
                            f"(registered: {', '.join(transports.available())})")


def warn_unguaranteed(method: Method) -> None:
    """Warn about a method x compressor pair with no convergence guarantee that diverges in practice:
    error feedback (EF, EF21) around an unbiased compressor that is not contractive (omega >= 1, e.g.
    QSGD with few levels): EF's analysis needs ``delta``-contraction (Stich et al. 2018; Richtarik et
    al. 2021), and a scaled unbiased operator with omega >= 1 expands the error it feeds back."""
    comp = method.compressor
    if method.name not in ("ef", "ef21") or not comp.unbiased:
        return
    try:
        omega = float(comp.omega(1 << 16))
    except Exception:  # noqa: BLE001 - compressors without omega: nothing to say
        return
    if omega >= 1.0:
        cname = comp.name or type(comp).__name__
        warnings.warn(
            f"method {method.name!r} with compressor {cname!r} (unbiased, omega={omega:.3g} >= 1) has no "
            f"convergence guarantee and can diverge (its error feedback grows the error it feeds back): error "
            f"feedback needs a contractive compressor (topk, or {cname!r} scaled by 1/(omega+1): "
            f"'induced'/'compose'), or use 'diana' for unbiased compressors", UserWarning, stacklevel=3)
