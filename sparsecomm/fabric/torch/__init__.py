"""The real fabric: the :class:`~sparsecomm.fabric.base.Fabric` contract over torch.distributed.

:mod:`.torch_fabric` is :class:`~.torch_fabric.TorchFabric` (posting sends and receives, services,
the end of a run); it owns the job's fail-stop propagation (:class:`~.torch_failure.FailStop`, in
:mod:`.torch_failure`) and the waits for its posted operations (:class:`~.torch_waiters.Waits`, in
:mod:`.torch_waiters`); :mod:`.torch_ranks` names the job's ranks. ``sc.TorchFabric`` is the class.
"""
