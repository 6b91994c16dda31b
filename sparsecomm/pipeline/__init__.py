"""The communication pipeline: the middle of a step's data path, gradient -> bucket -> method ->
transport -> method -> gradient, shared by :class:`~sparsecomm.DistributedOptimizer` and the DDP hook
(:mod:`sparsecomm.ddp`), built by composition:

- :mod:`.core`: :class:`CommPipeline`, one worker's method + transport, taking one flat bucket through
  ``method.encode -> transport.start -> method.decode``; it owns the parts below and uses only the
  transport's public API;
- :mod:`.rounds`: the round strategies of ``start()`` (plain, per parameter, bucket-wide in one round or
  several); :mod:`.sparse_rows`: row-sparse gradients, never densified;
- :mod:`.states`: what checkpoints carry: the method states by bucket key (:class:`~.states.StateStore`)
  and the compressor's randomness (:class:`~.states.Generators`);
- :mod:`.accounting`: the byte counts of every round; :mod:`.nonfinite`: the NaN/Inf rule;
- :mod:`.resolve`: names -> transport, the pair check; :mod:`.settings`: the configuration every worker
  agrees on; :mod:`.step_size`: the step size theory prescribes for the method;
- :mod:`.buckets` and :mod:`.scheduler`: the buckets, and the schedulers the frontends own (the
  optimizer's :class:`~.scheduler.BucketScheduler`, the DDP hook's :class:`~.scheduler.HookScheduler`).
"""

from .core import CommPipeline

__all__ = ["CommPipeline"]
