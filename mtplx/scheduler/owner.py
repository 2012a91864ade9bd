"""The model-owner thread: the one thread that does a service's MLX work (MLX state is
thread-affine). It runs calls handed to it (`call_on_owner`), admits queued work and takes turns
at it, and sleeps when there is none. `MTPBatchGenerationService` says what its work is."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

from mtplx.runtime import release_free_heap
from mtplx.scheduler.config import IDLE_HEAP_RELEASE_S

_LIVE_OWNERS: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _shutdown_live_owners() -> None:
    """Stop owner threads before the interpreter finalizes: an MLX thread torn down during
    finalization aborts the process ("terminate called without an active exception")."""
    for owner in list(_LIVE_OWNERS):
        try:
            owner.shutdown(timeout_s=5)
        except Exception:
            pass


def fail_calls(calls: list, exc: BaseException) -> None:
    for fut, *_ in calls:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(type(exc)(str(exc)))


class ModelOwnerThread:
    """The owner thread's loop. A subclass provides its work: `_has_turns()` (work in progress),
    `_take_ready_locked()` (queued work that may start now, and how long until more may),
    `_admit(taken)`, `_step_next_turn()`, `_abandon_work()` (the thread is stopping), and
    `shutdown(timeout_s)`."""

    def _init_owner(self) -> None:
        self._cond = threading.Condition()
        self._calls: deque = deque()
        self._closed_error: Optional[BaseException] = None
        self._stopping = False
        self._busy = False
        self._heap_dirty = False                # work ran since the last release_free_heap
        self._step_began_s = time.monotonic()   # when the owner began its current unit of work (watchdogs)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._owner_main, name="mtplx-model-owner", daemon=True)
            self._thread.start()

    @property
    def owner_alive(self) -> bool:
        return bool(self._thread is not None and self._thread.is_alive())

    def owner_step_age_s(self) -> Optional[float]:
        """Seconds the owner has spent on its current cycle, prefill chunk or call (None when
        idle): a watchdog's measure of a stuck model thread."""
        return round(time.monotonic() - self._step_began_s, 3) if self._busy else None

    def call_on_owner(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the model-owner thread at the next cycle boundary (MLX
        work that is not a request: lane installation, warm-up, a health probe). Returns a Future."""
        fut: Future = Future()
        with self._cond:
            if self._closed_error is not None:
                fut.set_exception(type(self._closed_error)(str(self._closed_error)))
                return fut
            self._calls.append((fut, fn, args, kwargs))
            self._cond.notify_all()
        return fut

    def _owner_main(self) -> None:
        import mlx.core as mx

        try:
            self._owner_loop()
        finally:
            self._abandon_work()
            mx.clear_streams()   # MLX needs its per-thread streams torn down by the thread itself

    def _owner_loop(self) -> None:
        _LIVE_OWNERS.add(self)
        while True:
            with self._cond:
                self._busy = self._has_turns()
                taken = self._wait_for_work_locked()
                if self._stopping:
                    return
                self._busy = self._heap_dirty = True
                self._step_began_s = time.monotonic()
                calls, self._calls = list(self._calls), deque()
            for fut, fn, args, kwargs in calls:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)
            self._admit(taken)
            self._step_next_turn()

    def _wait_for_work_locked(self) -> list:
        """Work ready to start, once there is any (or a call, or a stop). While idle after work,
        hands the C heap's free pages back to the OS once (10-20 ms: without the lock)."""
        idle_since = time.monotonic()
        while not self._stopping and not self._calls and not self._has_turns():
            taken, wait_s = self._take_ready_locked()
            if taken:
                return taken
            if self._heap_dirty:
                left = IDLE_HEAP_RELEASE_S - (time.monotonic() - idle_since)
                if left <= 0:
                    self._heap_dirty = False
                    self._cond.release()
                    try:
                        release_free_heap()
                    finally:
                        self._cond.acquire()
                    continue
                wait_s = left if wait_s is None else min(wait_s, left)
            self._cond.wait(wait_s)
        return self._take_ready_locked()[0]
