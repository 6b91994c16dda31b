"""The simulated fabric: n endpoints as threads of one process over a modelled network, in modelled time.

:mod:`.sim` is the Fabric API (:class:`~.sim.SimFabric`, one per endpoint, and :class:`~.sim.SimWorld`,
the run they share); :mod:`.sim_world` the scheduler that decides in modelled time which blocked endpoint
proceeds; :mod:`.sim_network` the network model (:class:`~.sim_network.Network`: links, NICs, message
timing, faults). The package's public names are on :mod:`sparsecomm` (``sc.SimFabric``, ``sc.Network``).
"""
