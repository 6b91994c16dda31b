"""Where people already train: the communication statistics as scalars for their loggers
(:mod:`~sparsecomm.integrations.stats`: TensorBoard, wandb, any callable) and PyTorch Lightning
(:mod:`~sparsecomm.integrations.lightning`, imported on its own: it needs the ``lightning`` extra).

HuggingFace Accelerate needs no glue: :func:`sparsecomm.ddp.register` takes the
``DistributedDataParallel`` module that ``accelerator.prepare`` returns under ``accelerate launch`` (the
README's "Where you already train")."""

from .stats import NAMES, StatsLogger, scalars

__all__ = ["NAMES", "StatsLogger", "scalars"]
