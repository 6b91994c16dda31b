"""PyTorch Lightning: sparsecomm's DDP communication hook under Lightning's ``DDPStrategy``, its statistics
through ``self.log``.

Needs the ``lightning`` extra (``pip install "sparsecomm[lightning]"``; the ``lightning`` package, imported
as ``lightning.pytorch``); without it, importing this module raises
:class:`~sparsecomm.errors.MissingExtraError` naming it. :class:`CommHook` is a Lightning ``Callback``::

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from sparsecomm.integrations.lightning import CommHook

    hook = CommHook(method=sc.methods.ef(sc.compressors.topk(ratio=0.1)), transport="allgather", log_every=10)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=[hook], log_every_n_steps=10)

(the README's "Where you already train" runs this as a whole script, ``tests/frontends/test_lightning.py``).

**Why a callback and not** ``DDPStrategy(ddp_comm_hook=sc.ddp.comm_hook, ddp_comm_state=state)``:
Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only when its root device is a CUDA device (on CPU
the hook is ignored without a word: ``DDPStrategy._register_ddp_hooks`` in lightning 2.6's
``lightning/pytorch/strategies/ddp.py``), and ``ddp_comm_state`` is built in the script before Lightning starts
the processes and their process group, while :class:`~sparsecomm.ddp.CommHookState` is built by a
collective over that group (every worker checks that every worker chose the same settings). At
``on_fit_start`` the strategy has initialised the process group and wrapped the module in
``DistributedDataParallel``, and no backward has run: :class:`CommHook` registers the hook there
(:func:`sparsecomm.ddp.register` with its keywords), on CPU and GPU alike, keyed by the module's parameter
names. A strategy that does not wrap the module in ``DistributedDataParallel`` is refused with
:class:`~sparsecomm.errors.IncompatibleError`.

**DistributedOptimizer does not fit Lightning.** Every Lightning strategy that trains one module on
several processes (``DDPStrategy``, ``"ddp"``, ``"ddp_spawn"``) wraps it in ``DistributedDataParallel``
while fitting, which averages the gradients during backward; a
:class:`~sparsecomm.DistributedOptimizer` returned by ``configure_optimizers`` (automatic or manual
optimization alike) would then average the averaged gradients a second time: twice the traffic, and a
compressing method's state (EF's error, DIANA's shifts) built from gradients that are already equal on
every worker. And Lightning checkpoints rank 0's ``optimizer.state_dict()`` and loads it on every rank,
while the optimizer's ``"sparsecomm"`` entry is per worker and refused on another rank
(:class:`~sparsecomm.errors.MismatchError`). :class:`CommHook` refuses an optimizer that is a
``DistributedOptimizer`` (:class:`~sparsecomm.errors.IncompatibleError`); the hook is the way in.

**Statistics.** With ``log_every=N``, every N-th global step the callback logs
:func:`sparsecomm.integrations.stats.scalars` of the hook state through the module's ``log_dict`` (on
step, rank 0's figures reach the loggers); Lightning hands logged values to its loggers every
``log_every_n_steps`` steps of the ``Trainer``, so set both.

**Checkpoints.** The hook's method state (EF's error, ...) is per worker and Lightning writes one
checkpoint from rank 0, so it is not in Lightning's checkpoints: a run resumed from one starts the method
afresh (step counter included, so its first step is averaged uncompressed), as DeepSpeed restarts its
error feedback. :attr:`CommHook.state` has ``state_dict()`` for a per-rank file of one's own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ddp import CommHookState, comm_hook, register
from ..errors import IncompatibleError, MissingExtraError
from ..optim import DistributedOptimizer
from .stats import StatsLogger

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ModuleNotFoundError as e:
    raise MissingExtraError(
        f"sparsecomm.integrations.lightning needs the 'lightning' extra, which is not installed here "
        f"(missing: {e.name}); install it with: pip install \"sparsecomm[lightning]\" (from the source tree: "
        f"pip install -e \".[lightning]\")", name=e.name) from e

__all__ = ["CommHook"]


class CommHook(Callback):
    """``CommHook(*, log_every=0, prefix="sparsecomm/", **options)``: registers sparsecomm's DDP hook on
    the module the strategy wrapped (``options``: the keywords of :func:`sparsecomm.ddp.register` and
    :class:`~sparsecomm.ddp.CommHookState`: ``compressor``, ``method``, ``transport``, ``warmup_steps``,
    ...) at ``on_fit_start``, and with ``log_every=N`` logs the statistics every N global steps (see the
    module doc). A later ``fit`` of the same trainer keeps the state (:attr:`state`)."""

    def __init__(self, *, log_every: int = 0, prefix: str = "sparsecomm/", **options: Any) -> None:
        super().__init__()
        self.options = options
        self.log_every = int(log_every)
        self.prefix = prefix
        #: the :class:`~sparsecomm.ddp.CommHookState` (``None`` before the first fit starts)
        self.state: CommHookState | None = None
        self._log: StatsLogger | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Register the hook on ``trainer.strategy.model`` (the ``DistributedDataParallel`` wrapper of
        ``pl_module``), a collective on every rank; raises :class:`~sparsecomm.errors.IncompatibleError`
        for a ``DistributedOptimizer`` among ``trainer.optimizers`` or a module not wrapped in DDP."""
        bad = [type(o).__name__ for o in trainer.optimizers if isinstance(o, DistributedOptimizer)]
        if bad:
            raise IncompatibleError(
                f"configure_optimizers returned a sparsecomm DistributedOptimizer ({', '.join(bad)}) and CommHook "
                f"averages the gradients in DDP's backward: they would be averaged twice; return the inner "
                f"torch optimizer (under Lightning the hook does the communication)")
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise IncompatibleError(
                f"sparsecomm's CommHook installs a DDP communication hook, but the strategy "
                f"{type(trainer.strategy).__name__} did not wrap the module in DistributedDataParallel "
                f"(it holds a {type(model).__name__}); use strategy=DDPStrategy(...) or strategy=\"ddp\"")
        if self.state is None:
            self.state = register(model, **self.options)
        else:                              # a new DistributedDataParallel wrapper (another fit)
            self.state.set_model(model)
            model.register_comm_hook(self.state, comm_hook)
        if self.log_every:
            self._log = StatsLogger(self.state, lambda values, step: pl_module.log_dict(
                values, on_step=True, on_epoch=False), every=self.log_every, prefix=self.prefix)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """With ``log_every=N``: log the statistics through ``pl_module.log_dict`` when
        ``trainer.global_step`` is a multiple of N (once per step; ``outputs``, ``batch`` and ``batch_idx``
        are not used)."""
        if self._log is not None:
            self._log(step=trainer.global_step)
