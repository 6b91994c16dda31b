"""The netbed: a rack of real processes over shaped links, on one machine (see :mod:`.topology`)."""

from ..errors import NetbedError
from .topology import Netbed, check_privileges, cleanup_stale, list_netbed_namespaces

__all__ = ["Netbed", "NetbedError", "check_privileges", "cleanup_stale", "list_netbed_namespaces"]
