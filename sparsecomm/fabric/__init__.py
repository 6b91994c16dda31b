"""Point-to-point fabrics: SimFabric (in-process, modelled network) and TorchFabric (torch.distributed).

The contract and the capabilities every fabric declares are in :mod:`.base`, the ledger in :mod:`.stats`, what a
fabric runs (a protocol's endpoint as roles, generators yielding their I/O, and their scheduler) in :mod:`.roles`,
its communication thread (the asynchronous calls of every protocol on it, in submission order) in :mod:`.engine`;
:mod:`.services` maps service specs to service loops. The two fabrics are sub-packages: :mod:`.sim` (the
simulation: :mod:`.sim.sim`, the Fabric API, over :mod:`.sim.sim_world`, the scheduler, and
:mod:`.sim.sim_network`, the network model) and :mod:`.torch` (torch.distributed:
:mod:`.torch.torch_fabric`, which owns its fail-stop propagation, :mod:`.torch.torch_failure`, and its
waits, :mod:`.torch.torch_waiters`).
"""

from .base import Fabric, Work
from .stats import CommStats

__all__ = ["Fabric", "Work", "CommStats"]
