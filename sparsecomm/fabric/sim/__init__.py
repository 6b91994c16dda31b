"""The simulated fabric: n endpoints of one process over a modelled network, in modelled time, run by one
discrete-event loop.

:mod:`.sim` is the Fabric API (:class:`~.sim.SimFabric`, one per endpoint, and :class:`~.sim.SimWorld`,
the run they share); :mod:`.sim_world` the loop that runs every endpoint's processes in modelled time
(no thread, no lock: threads of user code call in through :mod:`sparsecomm.fabric.sim_gate`);
:mod:`.sim_network` the network model (:class:`~.sim_network.Network`: links, NICs, message timing, faults);
:mod:`.sim_host` the hosts' CPU costs (:class:`~.sim_host.HostModel`, off by default), :mod:`.sim_profile` their
profiles (measured by :mod:`sparsecomm.netbed.calibrate`). The package's public names are on :mod:`sparsecomm`
(``sc.SimFabric``, ``sc.Network``).
"""
