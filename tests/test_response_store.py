"""The responses store (deployments.ingress.response_store): one SQLite file that several
ingress replicas open at once. Two stores (two connections, as two replicas hold) write to one
file at the same time without losing or corrupting a record; a store opened later on the file
reads everything; records are partitioned by owner and expire. No Ray."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from deployments.ingress.response_store import ResponseStore, StoredResponse


def _record(i: int, owner: str = "alice", created_at: float = None) -> StoredResponse:
    rid = f"resp_{i:05d}"
    body = {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": "é" * (i % 7)}]}]}
    return StoredResponse(rid, owner, time.time() if created_at is None else created_at, body,
                          [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": str(i)}]}])


def test_two_stores_write_one_file_at_once(tmp_path):
    path = tmp_path / "nested" / "responses.sqlite3"          # its folder is made
    stores = [ResponseStore(str(path)), ResponseStore(str(path))]
    assert all(s.journal_mode == "wal" for s in stores)
    errors, start = [], threading.Barrier(2)

    def write(k: int) -> None:
        try:
            start.wait()
            for i in range(k, 400, 2):               # interleaved: both writers contend for the lock throughout
                stores[k].put(_record(i))
                if i % 10 == k and i >= 2:
                    stores[k].delete("alice", f"resp_{i - 2:05d}")
        except Exception as exc:                     # a "database is locked" here would be the failure
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    deleted = {f"resp_{i - 2:05d}" for i in range(2, 400) if i % 10 in (0, 1)}
    later = ResponseStore(str(path))                 # a replica that starts afterwards
    try:
        assert later.count() == 400 - len(deleted)
        for i in range(400):
            got = later.get("alice", f"resp_{i:05d}")
            assert (got is None) == (f"resp_{i:05d}" in deleted), i
            if got is not None:
                assert got.response == _record(i).response and got.context == _record(i).context
        with sqlite3.connect(str(path)) as raw:
            assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        for s in stores + [later]:
            s.close()


def test_records_are_partitioned_by_owner_and_expire(tmp_path):
    store = ResponseStore(str(tmp_path / "r.sqlite3"), max_age_s=60)
    try:
        store.put(_record(1, owner="alice"))
        assert store.get("bob", "resp_00001") is None and not store.delete("bob", "resp_00001")
        assert store.get("alice", "resp_00001") is not None
        store.put(_record(2, owner="alice", created_at=time.time() - 120))     # past its age: never served
        assert store.get("alice", "resp_00002") is None
        store.put(_record(3, owner="alice"))                                   # a write deletes expired records
        assert store.count() == 2 and store.delete("alice", "resp_00001") and store.count() == 1
    finally:
        store.close()


def test_a_failed_write_leaves_nothing_half_written(tmp_path):
    store = ResponseStore(str(tmp_path / "r.sqlite3"))
    try:
        bad = StoredResponse("resp_bad", "alice", time.time(), {"x": object()}, [])
        with pytest.raises(TypeError):
            store.put(bad)
        store.put(_record(1))                         # the store is still usable: no transaction left open
        assert store.count() == 1 and store.get("alice", "resp_bad") is None
    finally:
        store.close()


@pytest.mark.ray
def test_the_actor_store_is_one_for_every_ingress_and_survives_a_restart(serve_app, tmp_path):
    """`responses_store: actor` (several machines): every ingress's client reaches one actor that
    owns the file; killed, Ray restarts it and the records are still there (they are in the file,
    not in the actor)."""
    import asyncio

    import ray

    from deployments.ingress.response_store import STORE_ACTOR_NAME, STORE_ACTOR_NAMESPACE, ActorStoreClient

    path = str(tmp_path / "actor.sqlite3")
    ingresses = [ActorStoreClient(path), ActorStoreClient(path)]

    async def write_then_read():
        await asyncio.gather(*(ingresses[i % 2].put(_record(i)) for i in range(20)))
        return await asyncio.gather(*(ingresses[(i + 1) % 2].get("alice", f"resp_{i:05d}") for i in range(20)))

    try:
        found = asyncio.run(write_then_read())
        assert [f.response for f in found] == [_record(i).response for i in range(20)]
        actor = ray.get_actor(STORE_ACTOR_NAME, namespace=STORE_ACTOR_NAMESPACE)
        first = ray.get(actor.where.remote())
        ray.kill(actor, no_restart=False)
        again = asyncio.run(ingresses[0].get("alice", "resp_00007"))
        assert again is not None and again.response == _record(7).response
        assert asyncio.run(ingresses[1].delete("alice", "resp_00007"))
        assert ray.get(actor.where.remote()) == first
        later = ResponseStore(path)          # the file itself, read directly
        assert later.count() == 19
        later.close()
    finally:
        ray.kill(ray.get_actor(STORE_ACTOR_NAME, namespace=STORE_ACTOR_NAMESPACE), no_restart=True)
