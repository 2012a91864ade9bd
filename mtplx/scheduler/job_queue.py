"""The queue jobs wait in before admission, oldest first, and when a key's jobs may leave it.
Not thread-safe on its own: the service holds its lock around every call."""

from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional


class JobQueue:
    """Jobs not yet admitted. A key's jobs are ready to leave together when they came as a
    cohort, the key already runs, a full lane's worth waits, or the oldest has waited
    `batch_wait_s` for company."""

    def __init__(self, batch_wait_s: float):
        self.batch_wait_s = max(0.0, float(batch_wait_s))
        self._jobs: deque = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def of_key(self, key) -> int:
        return sum(1 for j in self._jobs if j.compatibility_key == key)

    def extend(self, jobs: Iterable) -> None:
        self._jobs.extend(jobs)

    def put_back(self, jobs: list) -> None:
        """Jobs that could not be admitted yet: first in the queue again, in their order."""
        self._jobs.extendleft(reversed(jobs))

    def remove(self, job) -> bool:
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        return True

    def clear(self) -> list:
        jobs, self._jobs = list(self._jobs), deque()
        return jobs

    def drop_ended(self) -> list:
        """Remove and return the jobs that ended while they waited (cancelled, failed)."""
        ended = [j for j in self._jobs if j.cancel_requested() or j.future.done()]
        for job in ended:
            self._jobs.remove(job)
        return ended

    def take_ready(self, running_keys, max_rows: int, at_once: bool = False,
                   head_key_only: bool = False) -> tuple:
        """(jobs that may leave now, seconds until more may; None: no limit). `at_once`: every
        job is ready; `head_key_only`: the oldest job's key alone, ready whatever its wait."""
        if not self._jobs:
            return [], None
        by_key: dict = {}
        for job in self._jobs:
            by_key.setdefault(job.compatibility_key, []).append(job)
        if head_key_only:
            head = self._jobs[0].compatibility_key
            by_key = {head: by_key[head]}
        now = time.perf_counter()
        taken, wait_s = [], None
        for key, jobs in by_key.items():
            due = jobs[0].created_s + self.batch_wait_s
            if (at_once or head_key_only or now >= due or key in running_keys or len(jobs) >= max_rows
                    or any(j._ready for j in jobs)):
                taken.extend(jobs)
            else:
                wait_s = _sooner(wait_s, due - now)
        for job in taken:
            self._jobs.remove(job)
        return taken, wait_s


def _sooner(a: Optional[float], b: float) -> float:
    return b if a is None else min(a, b)
