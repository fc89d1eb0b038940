"""The ``workers:`` setting of the server's config: a fixed count, or a range the server sizes
itself within (``server/compute/autoscale.py``).

Example::

    workers: 4                                     # always 4 worker processes
    workers: {min: 1, max: 8}                      # 1 to 8, as the clients' wait for data asks
    workers: {min: 2, max: 8, cool_down_s: 60, cpu_quota: 6}
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import StrictModel


class WorkerRange(StrictModel):
    """Worker processes sized to demand.

    min: workers always running (>= 1); the pool starts with these. max: the most it runs.
    cool_down_s: seconds without a client waiting for data before an idle worker is retired (and
        between two retirements).
    cpu_quota: CPUs the workers may use; the pool never runs more than ``floor(cpu_quota)``
        workers (nor fewer than ``min``). None (default): the container's cgroup CPU limit (v2
        ``cpu.max``, v1 ``cpu.cfs_quota_us``), else the CPUs the server may run on.
    """

    min: int = Field(default=1, ge=1, le=512)
    max: int = Field(ge=1, le=512)
    cool_down_s: float = Field(default=30.0, gt=0)
    cpu_quota: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "WorkerRange":
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be at least min ({self.min})")
        return self
