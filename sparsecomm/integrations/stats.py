"""Communication statistics as flat scalars with stable names, sent every N steps to where a run logs.

:func:`scalars` reads a *source*, anything with ``compression_stats()`` and ``last_stats`` (a
:class:`~sparsecomm.DistributedOptimizer`, a :class:`~sparsecomm.ddp.CommHookState`), and returns, per
worker (the keys are :data:`NAMES`, each behind ``prefix``):

==========================  ===================================================================================
``bytes_dense``             cumulative bytes the averaged gradients stand for (plain fp32/fp64 all-reduce inputs)
``bytes_payload``           cumulative bytes the compressor declares it sends (``Payload.bits / 8``)
``bytes_saved``             ``bytes_dense - bytes_payload``
``compression_factor``      ``bytes_dense / bytes_payload`` (NaN before the first round)
``bytes_sent``              cumulative bytes the transport's ledger counted (headers included)
``compression_factor_sent`` the factor measured on the wire (NaN before the first send)
``steps``                   steps completed (the optimizer's synchronisations, the hook's DDP iterations)
``step_bytes_sent``         the last step's bytes sent
``step_comm_time_s``        the last step's time inside the transport's calls, summed over its rounds (wall clock;
                            with overlap it runs beside backward, so it bounds the exposed time from above)
``step_modelled_time_s``    the last step's time on the SimFabric's modelled network (0 on real fabrics)
==========================  ===================================================================================

The cumulative figures are those of ``compression_stats()``
(:meth:`CompressionStats.as_dict <sparsecomm.pipeline.accounting.CompressionStats.as_dict>`), the
per-step ones the source's ``last_stats`` (:class:`~sparsecomm.fabric.stats.CommStats`).

:class:`StatsLogger` calls :func:`scalars` every ``every`` steps and hands the values to a sink: a
TensorBoard ``SummaryWriter`` (anything with ``add_scalar(tag, value, global_step)``), a wandb run or the
``wandb`` module (anything with ``log(dict)``, which gets the step as the metric ``<prefix>step``, as
Lightning's ``WandbLogger`` logs ``trainer/global_step``), or a callable ``sink(values, step)``::

    writer = torch.utils.tensorboard.SummaryWriter("runs/topk")
    log = StatsLogger(opt, writer, every=50)      # opt: a DistributedOptimizer (or a CommHookState)
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        log()                                     # writes at steps 50, 100, ...

Lightning's ``self.log``: :class:`sparsecomm.integrations.lightning.CommHook` (``log_every=N``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import InvalidTypeError, InvalidValueError
from ..validate import check_int

#: the names :func:`scalars` returns (before the prefix), in this order
NAMES = ("bytes_dense", "bytes_payload", "bytes_saved", "compression_factor", "bytes_sent",
         "compression_factor_sent", "steps", "step_bytes_sent", "step_comm_time_s", "step_modelled_time_s")


def scalars(source: Any, prefix: str = "sparsecomm/") -> dict[str, float]:
    """The statistics of ``source`` (see the module doc) as ``{prefix + name: value}``, in :data:`NAMES`
    order; ints stay ints."""
    if not (callable(getattr(source, "compression_stats", None)) and hasattr(source, "last_stats")):
        raise InvalidTypeError(
            f"the statistics come from an object with compression_stats() and last_stats (a "
            f"sparsecomm.DistributedOptimizer or a sparsecomm.ddp.CommHookState), got a {type(source).__name__}")
    total, last = source.compression_stats(), source.last_stats
    values = {"bytes_dense": total["bytes_dense"], "bytes_payload": total["bytes_payload"],
              "bytes_saved": total["bytes_dense"] - total["bytes_payload"],
              "compression_factor": total["compression_factor"], "bytes_sent": total["bytes_sent"],
              "compression_factor_sent": total["compression_factor_sent"], "steps": total["steps"],
              "step_bytes_sent": last.bytes_sent, "step_comm_time_s": last.wall_time_s,
              "step_modelled_time_s": last.modelled_time_s}
    return {prefix + k: values[k] for k in NAMES}


def _writer(sink: Any, prefix: str) -> Callable[[dict[str, float], int], None]:
    """``sink`` as a function ``(values, step)`` (see :class:`StatsLogger`)."""
    if callable(getattr(sink, "add_scalar", None)):
        def tensorboard(values: dict[str, float], step: int) -> None:
            for k, v in values.items():
                sink.add_scalar(k, v, step)
        return tensorboard
    if callable(getattr(sink, "log", None)) and not callable(sink):
        return lambda values, step: sink.log({**values, prefix + "step": step})
    if callable(sink):
        return sink
    raise InvalidTypeError(f"a StatsLogger sink is a SummaryWriter (add_scalar), a wandb run (log) or a "
                           f"callable (values, step); got a {type(sink).__name__}")


class StatsLogger:
    """``StatsLogger(source, sink, every=1, prefix="sparsecomm/")``: call it once per training step,
    after the optimizer's step; at every step that is a multiple of ``every`` (once per step however often
    it is called) it sends :func:`scalars` of ``source`` to ``sink`` and returns them (else ``None``).

    The step is ``step=`` when given (a trainer's global step), else the source's ``steps``. ``sink``:
    see the module doc."""

    def __init__(self, source: Any, sink: Any, every: int = 1, prefix: str = "sparsecomm/") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidValueError(f"every must be a positive int (log every N steps), got {every!r}")
        scalars(source, prefix)          # a source without the statistics fails here, not at step N
        self.source, self.every, self.prefix = source, every, prefix
        self._write = _writer(sink, prefix)
        self._last: int | None = None

    def __call__(self, step: int | None = None) -> dict[str, float] | None:
        step = int(self.source.compression_stats()["steps"]) if step is None else \
            check_int("step", step, low=0, what="StatsLogger")
        if step % self.every or step == self._last:
            return None
        self._last = step
        values = scalars(self.source, self.prefix)
        self._write(values, step)
        return values
