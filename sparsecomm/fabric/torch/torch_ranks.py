"""The ranks of a torch.distributed job as a TorchFabric sees them: workers ``0 .. world_size-1``, then
one rank per service spec (rank ``world_size + i`` serves ``services[i]``), and the names that errors give
them ("worker 2", "service 'switch' (rank 4)"). A fabric over a subgroup numbers its workers by their
rank in the group and names each with its rank in the job too ("worker 1 (job rank 3)")."""

from __future__ import annotations

from typing import Sequence


class JobRanks:
    """The job's workers and service ranks (see the module docstring)."""

    def __init__(self, world_size: int, services: Sequence[str],
                 job_ranks: Sequence[int] | None = None) -> None:
        self.world_size = world_size
        #: worker i's rank in the job (a fabric over a subgroup), or ``None`` (worker i is job rank i)
        self.job_ranks = list(job_ranks) if job_ranks is not None else None
        #: service spec -> its rank
        self.services = {spec: world_size + i for i, spec in enumerate(services)}

    @property
    def total(self) -> int:
        """Every rank of the job: workers and services."""
        return self.world_size + len(self.services)

    def spec(self, rank: int) -> str | None:
        """The service spec that ``rank`` serves, or ``None`` for a worker."""
        return next((s for s, r in self.services.items() if r == rank), None)

    def name(self, rank: int | None) -> str:
        """``rank`` as errors name it; ``None`` (a receive from any source) is "any rank"."""
        if rank is None:
            return "any rank"
        if rank < self.world_size:
            if self.job_ranks is None:
                return f"worker {rank}"
            return f"worker {rank} (job rank {self.job_ranks[rank]})"
        spec = self.spec(rank)
        return f"service {spec!r} (rank {rank})" if spec is not None else f"rank {rank}"
