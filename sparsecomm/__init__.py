"""sparsecomm: gradient compression, sparse collectives and in-network aggregation in one toolbox.

>>> import sparsecomm as sc
>>> c = sc.compressors.get("randk", ratio=0.01)
>>> c.unbiased, c.omega(1000)                             # E||C(x) - x||^2 <= omega ||x||^2
(True, 99.0)
>>> def fn(ctx):                                          # runs on every worker
...     return ctx.rank
>>> sc.launch(fn, world_size=8, backend="sim", network=sc.Network(bandwidth_gbps=100))
[0, 1, 2, 3, 4, 5, 6, 7]
"""

from importlib import import_module as _import_module

__version__ = "0.1.0"

from . import _tree

_tree.install()  # source tree: sparsecomm.theory etc. are the top-level folders (see _tree.py)

from . import errors, registry  # noqa: F401
from . import ddp_wrapped as _ddp_wrapped

_ddp_wrapped.install()  # records DistributedDataParallel wrappers, which DistributedOptimizer refuses
from .payload import Payload  # noqa: F401

# ``sparsecomm.launch`` is both a module and its main function: bind the function eagerly, so that a
# later ``import sparsecomm.launch`` (which finds the module already loaded) cannot shadow it.
from .launch import Context, backends as _backends, current_context, launch  # noqa: E402,F401
from .launch import base as _launch_base  # noqa: E402
from .fabric.sim.sim import SimFabric  # noqa: E402,F401
from .fabric.sim.sim_network import Network  # noqa: E402,F401
from .fabric.sim.sim_host import HostModel  # noqa: E402,F401

# the netbed backend sits above launch (it runs the gloo backend's ranks in namespaces): the package's top
# declares it, and launch imports it on first use
_backends.provide("netbed", "sparsecomm.netbed.launch")
# the fork server of the spawning backends imports the optimizer stack, initialises Numba's CPU target and loads
# the default path's cached kernels once, before it forks the ranks (each rank would otherwise pay them at its
# first optimizer and first step)
_launch_base.preload("sparsecomm.optim", "sparsecomm._numba_warm")

# Sub-packages and top-level names are imported lazily so that ``import sparsecomm`` stays cheap
# (torch.distributed and numba are only paid for when used).
_LAZY = {
    "codec": ("sparsecomm.codec", None),
    "kernels": ("sparsecomm.kernels", None),
    "compressors": ("sparsecomm.compressors", None),
    "methods": ("sparsecomm.methods", None),
    "transports": ("sparsecomm.transports", None),
    "fabric": ("sparsecomm.fabric", None),
    "ddp": ("sparsecomm.ddp", None),
    "integrations": ("sparsecomm.integrations", None),
    "trace": ("sparsecomm.trace", None),
    "TorchFabric": ("sparsecomm.fabric.torch.torch_fabric", "TorchFabric"),
    "CommStats": ("sparsecomm.fabric.stats", "CommStats"),
    "DistributedOptimizer": ("sparsecomm.optim", "DistributedOptimizer"),
}


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'sparsecomm' has no attribute {name!r}") from None
    mod = _import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


#: the public names of the package (``dir(sparsecomm)``; the sub-packages and classes above are loaded on
#: first use)
__all__ = sorted({"__version__", "errors", "registry", "Payload", "Context", "current_context", "launch",
                  "Network", "HostModel", "SimFabric", *_LAZY})


def __dir__():
    return list(__all__)
