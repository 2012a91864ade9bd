"""Stored responses (the Responses API's `store`, `previous_response_id`, GET and DELETE): an
embedded SQLite file that every ingress replica of a machine opens, so that a response one
replica stored is read, continued and deleted through any other, and outlives them all.

SQLite is safe for several processes on one machine when it is used so: write-ahead logging (WAL:
readers never block the writer, a crash never leaves half a write), a busy timeout (a writer waits
for another's lock instead of failing at once) and every write one transaction (`BEGIN IMMEDIATE`
takes the write lock before reading, so two writers never deadlock). WAL needs the file on a local
disk: a network file system (NFS, SMB) does not give its shared memory to processes of different
machines. Several machines share one store through `ResponseStoreActor` (`responses_store:
"actor"`): one Ray actor owns the file on one node and every ingress calls it (README).

Records are partitioned by owner, the digest of the caller's API key (`auth.caller_digest`; ""
with no keys configured): another key's response is not found, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

log = logging.getLogger("ray.serve")

DEFAULT_STORE_PATH = "~/.cache/mtplx/responses.sqlite3"
BUSY_TIMEOUT_MS = 10_000
SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (owner TEXT NOT NULL, id TEXT NOT NULL, created_at REAL NOT NULL, "
          "response TEXT NOT NULL, context TEXT NOT NULL, PRIMARY KEY (owner, id)) WITHOUT ROWID",
          "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)")


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: the response object as the client got it, and its context (the items
    its model saw before its output: the history it continued, then its own input)."""

    id: str
    owner: str
    created_at: float
    response: dict
    context: list


class ResponseStore:
    """One SQLite file (created with its folder when missing). Thread-safe: one connection, one
    thread at a time. `max_age_s`: records older than this are deleted (None: kept)."""

    def __init__(self, path: str, max_age_s: Optional[float] = None):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                     check_same_thread=False)
        with self._lock:
            self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.journal_mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            self._conn.execute("PRAGMA synchronous=NORMAL")
            with self._write():
                for statement in SCHEMA:
                    self._conn.execute(statement)
        if self.journal_mode.lower() != "wal":
            log.warning("mtplx responses store %s: SQLite refused write-ahead logging (journal mode %s): is it on a "
                        "network file system? Replicas on this machine still share it safely, more slowly",
                        self.path, self.journal_mode)

    @contextmanager
    def _write(self):
        """One write transaction; the lock is held (its caller took it)."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def put(self, record: StoredResponse) -> None:
        row = (record.owner, record.id, float(record.created_at), json.dumps(record.response, ensure_ascii=False),
               json.dumps(record.context, ensure_ascii=False))
        with self._lock, self._write():
            self._conn.execute("INSERT OR REPLACE INTO responses (owner, id, created_at, response, context) "
                               "VALUES (?, ?, ?, ?, ?)", row)
            if self.max_age_s is not None:
                self._conn.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))

    def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            row = self._conn.execute("SELECT created_at, response, context FROM responses WHERE owner = ? AND id = ?",
                                     (owner, response_id)).fetchone()
        if row is None or (self.max_age_s is not None and row[0] < time.time() - self.max_age_s):
            return None
        return StoredResponse(response_id, owner, row[0], json.loads(row[1]), json.loads(row[2]))

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock, self._write():
            return self._conn.execute("DELETE FROM responses WHERE owner = ? AND id = ?",
                                      (owner, response_id)).rowcount > 0

    def count(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class LocalStoreClient:
    """The ingress's view of a store file: opened on first use (an ingress that serves no
    Responses request never creates it), its calls on one thread of their own, off the event
    loop (a write may wait for another replica's lock)."""

    def __init__(self, path: str, max_age_s: Optional[float] = None):
        self.where = f"sqlite:{Path(path).expanduser()}"
        self._open = partial(ResponseStore, path, max_age_s)
        self._store: Optional[ResponseStore] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mtplx-responses-store")

    def _call(self, method: str, *args):
        if self._store is None:
            self._store = self._open()
            log.info("mtplx ingress: responses store %s opened (journal mode %s)", self.where,
                     self._store.journal_mode)
        return getattr(self._store, method)(*args)

    async def _run(self, method: str, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(self._call, method, *args))

    async def put(self, record: StoredResponse) -> None:
        await self._run("put", record)

    async def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        return await self._run("get", owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._run("delete", owner, response_id)


# ----------------------------------------------------------------------------------------------
# Several machines: one actor owns the file


STORE_ACTOR_NAME = "mtplx-responses-store"
STORE_ACTOR_NAMESPACE = "mtplx"
HEAD_NODE = {"node:__internal_head__": 0.001}       # Ray's resource of the head node


class ResponseStoreActor:
    """A Ray actor (named, detached, on the head node) that owns the store file: every ingress
    replica, on any machine, reads and writes through it. Ray restarts it when it dies (its
    records are in the file, not in it); Ray's object store is not durable, the file is."""

    def __init__(self, path: str, max_age_s: Optional[float] = None):
        self.store = ResponseStore(path, max_age_s)

    def put(self, record: StoredResponse) -> None:
        self.store.put(record)

    def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        return self.store.get(owner, response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete(owner, response_id)

    def where(self) -> str:
        import ray

        return f"{ray.get_runtime_context().get_node_id()}:{self.store.path}"


class ActorStoreClient:
    """The ingress's view of the store actor (`responses_store: actor`): the actor is found, or
    made by the first replica that asks (on the head node, `path` on that node's disk)."""

    def __init__(self, path: str, max_age_s: Optional[float] = None, resources: Optional[dict] = None):
        self.where = f"actor:{STORE_ACTOR_NAMESPACE}/{STORE_ACTOR_NAME}:{path}"
        self._args = (path, max_age_s)
        self._resources = dict(HEAD_NODE if resources is None else resources)
        self._actor = None

    def _handle(self):
        if self._actor is None:
            import ray

            self._actor = ray.remote(ResponseStoreActor).options(
                name=STORE_ACTOR_NAME, namespace=STORE_ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, resources=self._resources, max_restarts=-1, max_task_retries=3).remote(*self._args)
        return self._actor

    async def put(self, record: StoredResponse) -> None:
        await self._handle().put.remote(record)

    async def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        return await self._handle().get.remote(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._handle().delete.remote(owner, response_id)
