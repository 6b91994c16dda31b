"""Which parameters a stock ``torch.nn.parallel.DistributedDataParallel`` (DDP) already averages, so that
:class:`~sparsecomm.DistributedOptimizer` refuses to average them a second time (DDP all-reduces the
full dense gradient in backward; an optimizer compressing after it would average twice and report a
compression that saved no byte).

torch (2.x) keeps no registry of its DDP wrappers and marks nothing on the parameters they average (the
reducer's hooks are C++ hooks on the parameters' gradient accumulators, invisible from Python), so this
module keeps one: :func:`install` adds a global module-registration hook
(``torch.nn.modules.module.register_module_module_registration_hook``), which sees every DDP take its
``module`` (the assignment in DDP's constructor) and records the wrapper in a weak set. ``import
sparsecomm`` installs it; if a process group was already initialised then (so that a wrapper may exist
already), the live objects are searched once for wrappers (``gc``: a fraction of a second, once per
process). :func:`refuse_wrapped` raises :class:`~sparsecomm.errors.IncompatibleError` for parameters
that a recorded wrapper averages (its ``parameters_to_ignore`` excepted).
"""

from __future__ import annotations

import gc
import weakref
from typing import Iterable

import torch

from .errors import IncompatibleError

_WRAPPERS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_HANDLE = None


def _ddp_class() -> type:
    return torch.nn.parallel.DistributedDataParallel


def _record(module: torch.nn.Module, name: str, submodule) -> None:
    """The registration hook: a DDP taking its ``module`` is recorded (nothing is changed)."""
    if name == "module" and isinstance(module, _ddp_class()):
        _WRAPPERS.add(module)


def install() -> None:
    """Install the registration hook (once per process); search the live objects for wrappers made
    before it when a process group is already initialised."""
    global _HANDLE
    if _HANDLE is not None:
        return
    _HANDLE = torch.nn.modules.module.register_module_module_registration_hook(_record)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        cls = _ddp_class()
        for obj in gc.get_objects():
            if issubclass(type(obj), cls):
                _WRAPPERS.add(obj)


def averaged_by(params: Iterable[torch.Tensor], module: torch.nn.Module | None = None
                ) -> list[tuple[torch.nn.Module, list[str]]]:
    """The DDP wrappers that average some of ``params``, and ``module`` if it is a wrapper itself (the
    optimizer's ``module=``: the model it trains), with the names, in each wrapper's module, of those
    parameters (all of ``module``'s)."""
    ids = {id(p) for p in params}
    found = list(_WRAPPERS)
    if module is not None and isinstance(module, _ddp_class()) and module not in found:
        found.append(module)
    out = []
    for ddp in found:
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        names = [n for n, p in ddp.module.named_parameters()
                 if n not in ignored and p.requires_grad and (id(p) in ids or ddp is module)]
        if names:
            out.append((ddp, names))
    return out


def refuse_wrapped(params: Iterable[torch.Tensor], module: torch.nn.Module | None = None,
                   when: str = "") -> None:
    """Raise :class:`~sparsecomm.errors.IncompatibleError` if a DDP wrapper averages some of ``params``
    (the optimizer's; ``module``: its ``module=``), naming both and the two ways out; ``when`` says
    where (``"at the first step"``) in the message."""
    hits = averaged_by(params, module)
    if not hits:
        return
    names = hits[0][1]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    at = f" ({when})" if when else ""
    raise IncompatibleError(
        f"DistributedOptimizer over parameters that torch.nn.parallel.DistributedDataParallel already "
        f"averages{at}: its module's {shown}. DDP all-reduces the full dense gradient in backward, so "
        f"DistributedOptimizer would average it a second time and its compression_stats would count a "
        f"compression that saved no byte. Either unwrap the model (train the bare module: "
        f"sc.DistributedOptimizer(torch.optim.SGD(model.parameters(), ...), ...) averages the gradients), or "
        f"keep DDP and compress inside it with a plain torch optimizer: "
        f"sparsecomm.ddp.register(ddp_model, compressor=..., ...)")
