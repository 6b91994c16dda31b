"""Point-to-point fabrics: SimFabric (in-process, modelled network) and TorchFabric (torch.distributed).

The contract and the capabilities every fabric declares are in :mod:`.base`; the simulation is
:mod:`.sim` (the Fabric API) over :mod:`.sim_world` (the scheduler) and :mod:`.sim_network` (the network
model); TorchFabric is :mod:`.torch_fabric` with its fail-stop propagation in :mod:`.torch_failure` and
its completion helpers in :mod:`.torch_waiters`; :mod:`.services` maps service specs to service loops.
"""

from .base import Fabric, Work
from .stats import CommStats

__all__ = ["Fabric", "Work", "CommStats"]
