"""An in-memory bank of prompt-prefix states, keyed by exact token prefix (boundary states) or
by the exact prompt (whole-prompt states; see mtplx.engine.prefix_cache), within a partition
(`salt`: a job's `cache_salt`, a digest of its caller and its request's cache salt; None: the
shared partition). A state banked in one partition is never found from another, so one caller
never learns from `cached_tokens` what another sent.

LRU within a byte budget; each entry carries the fingerprint of the model it was computed by
and only matches that model. Under a service with a memory budget the bank also fits in what the
rows' decode state leaves (`room`): rows come first, a banked prefix is only saved work. Hooks for
one request come from `hooks(prompt)`; they are what `MTPBatchJob(session_restore=...,
session_commit=...)` and the solo path take; `job_hooks(job)` gives a job its partition's.
`on_change(stored, salt, key, whole)`, when set, hears of every entry banked (stored True) and
every entry that left (evicted or replaced: False), under the bank's lock: the replica turns
these into the prefix-cache events the router's index follows.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Callable, Optional

from mtplx.engine.prefix_cache import PrefixState

DEFAULT_MAX_BYTES = 512 * 1024 * 1024


class SessionBank:
    def __init__(self, fingerprint: str, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.fingerprint = fingerprint
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[tuple, PrefixState]" = OrderedDict()   # (salt, key, whole) -> state
        # boundary keys' lengths (few: chunk multiples + 1), so that a lookup is one dict probe per
        # length instead of a scan of every entry (one whole-prompt entry per distinct prompt)
        self._boundary_lengths: Counter = Counter()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.commits = 0
        self.yielded = 0                  # entries evicted to make room for rows' decode state
        # bytes the decode state of running rows leaves the bank (set by a service with a budget)
        self.room: Optional[Callable[[], int]] = None
        self.on_change: Optional[Callable[[bool, Optional[str], tuple, bool], None]] = None

    def lookup(self, prompt, salt: Optional[str] = None) -> Optional[PrefixState]:
        """The whole-prompt state of exactly `prompt` in partition `salt`, else its longest banked
        boundary prefix there (at least one token of it left to prefill)."""
        prompt = tuple(prompt)
        with self._lock:
            entry = (salt, prompt, True)
            best = self._entries.get(entry)
            if best is None:
                for n in sorted((n for n in self._boundary_lengths if n <= len(prompt)), reverse=True):
                    entry = (salt, prompt[:n], False)
                    best = self._entries.get(entry)
                    if best is not None:
                        break
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(entry)
            self.hits += 1
            return best

    def limit(self) -> int:
        """The most bytes the bank may hold now."""
        return self.max_bytes if self.room is None else max(0, min(self.max_bytes, self.room()))

    def commit(self, state: PrefixState, salt: Optional[str] = None) -> None:
        """Bank `state` in partition `salt`."""
        size, limit = state.nbytes, self.limit()
        if size > limit:
            return
        with self._lock:
            old = self._entries.pop((salt, state.key, state.whole), None)
            if old is not None:
                self._forget(salt, old)
            self._entries[(salt, state.key, state.whole)] = state
            self._bytes += size
            if not state.whole:
                self._boundary_lengths[len(state.key)] += 1
            self.commits += 1
            self._changed(True, salt, state)
            self._evict_to(limit)

    def shrink(self, to_bytes: int) -> None:
        """Evict least recently used entries until the bank holds at most `to_bytes`: what rows
        about to join a lane need."""
        with self._lock:
            self.yielded += self._evict_to(max(0, to_bytes))

    def _evict_to(self, limit: int) -> int:
        evicted = 0
        while self._bytes > limit:
            (salt, _, _), state = self._entries.popitem(last=False)
            self._forget(salt, state)
            evicted += 1
        self.evictions += evicted
        return evicted

    def _changed(self, stored: bool, salt: Optional[str], state: PrefixState) -> None:
        if self.on_change is not None:
            try:
                self.on_change(stored, salt, state.key, state.whole)
            except Exception:     # a listener's problem only costs the router its news
                pass

    def _forget(self, salt: Optional[str], state: PrefixState) -> None:
        """Bookkeeping for an entry that has left `_entries`."""
        self._changed(False, salt, state)
        self._bytes -= state.nbytes
        if not state.whole:
            self._boundary_lengths[len(state.key)] -= 1
            if not self._boundary_lengths[len(state.key)]:
                del self._boundary_lengths[len(state.key)]

    def hooks(self, prompt, salt: Optional[str] = None):
        """(session_restore, session_commit) for one request's prompt, in partition `salt`."""
        commit = self.commit if salt is None else (lambda state: self.commit(state, salt))
        return (lambda: self.lookup(prompt, salt)), commit

    def job_hooks(self, job):
        """`hooks` for a job: its prompt, in its `cache_salt`'s partition."""
        return self.hooks(job.prompt_ids, job.cache_salt)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "yielded_to_rows": self.yielded, "commits": self.commits, "fingerprint": self.fingerprint}
