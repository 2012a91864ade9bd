"""The model replica in-process (no Ray Serve): per-key backpressure, error classes, the
check_health watchdog. Faults are forced only where they are rare: a closed service, a model
thread held busy."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

import process_state
from mtplx.api.rows import RowSpec
from mtplx.end import STOP_STRING, End
from mtplx.sampling import SamplerConfig


@pytest.fixture(scope="module")
def replica():
    from deployments.replica import MTPReplica

    # the replica sets what a serving process wants (BLAS threads, niceness, a frozen heap):
    # for this module only
    with process_state.restored():
        rep = MTPReplica(widths=(3,), warmup=False, max_waiting_rows_per_key=2, retry_after_s=2.0, watchdog_s=0.3)
        yield rep
        rep.__del__()          # what Serve calls when it stops a replica


def _row(rep, i: int, max_tokens: int = 6, prompt_ids=None, **fields) -> RowSpec:
    ids = prompt_ids or rep.model.tokenizer.encode(f"def f{i}(x):\n", add_special_tokens=False)
    return RowSpec(request_id=f"row-{i}", model=rep.model.model_id, prompt_ids=tuple(ids), max_tokens=max_tokens,
                   sampler=SamplerConfig(temperature=0.0), seed=i, **fields)


def _finals(rep, rows) -> dict:
    async def go():
        out = {}
        async for msg in rep.run_cohort(rows):
            out.update(msg.get("f") or {})
        return out

    return asyncio.run(go())


def _until_idle(rep, timeout_s: float = 30.0) -> None:
    """Wait for the rows earlier tests ended to leave their lane: a cancelled row's final goes out
    at once, and the row holds its slot (and counts against the key's bound) until the model
    thread's next step removes it."""
    from mtplx.api.rows import mtp_batch_compatibility_key

    key, deadline = mtp_batch_compatibility_key(rep.model.model_id), time.monotonic() + timeout_s
    while rep.service.rows_wanting(key):
        assert time.monotonic() < deadline, "the replica's lane never emptied"
        time.sleep(0.05)


def test_rows_beyond_the_per_key_bound_are_refused_at_once(replica):
    # widest lane 3 + 2 waiting rows = 5 rows of one key; the other 3 are refused with Retry-After
    _until_idle(replica)
    t0 = time.perf_counter()
    finals = _finals(replica, [_row(replica, i) for i in range(8)])
    refused = [f for f in finals.values() if "error" in f]
    served = [f for f in finals.values() if "error" not in f]
    assert len(served) == 5 and len(refused) == 3
    for f in refused:
        assert f["error"]["kind"] == "overloaded" and f["error"]["retry_after_s"] == 2.0
        assert "overloaded" in f["error"]["message"]
    assert all(f["completion_tokens"] >= 1 for f in served)
    assert time.perf_counter() - t0 < 60
    snap = asyncio.run(replica.snapshot())
    assert snap["overload_rejections"] == 3 and snap["live_requests"] == 0 and snap["waiting_rows"] == 0


def test_error_classes_reach_the_ingress_without_internals(replica):
    rows = [_row(replica, 20, max_tokens=replica.model.max_context),          # prompt + budget > context
            _row(replica, 21, prompt_ids=[replica.model.vocab_size + 5])]     # a bug upstream: not the client's
    finals = _finals(replica, rows)
    assert finals[0]["error"]["kind"] == "capacity" and "context window" in finals[0]["error"]["message"]
    assert finals[1]["error"] == {"kind": "internal"}     # a plain ValueError is no longer "context length"


def test_check_health_catches_a_stuck_model_thread(replica):
    replica.check_health()
    held = replica.service.call_on_owner(time.sleep, 1.5)   # the owner thread busy in one step
    time.sleep(0.7)
    with pytest.raises(RuntimeError, match="stuck"):
        replica.check_health()
    assert asyncio.run(replica.health())["ok"] is False
    held.result(timeout=10)
    # the owner marks itself idle just after the call returns (its next turn of the loop)
    deadline = time.monotonic() + 5
    while True:
        try:
            replica.check_health()
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_closed_service_answers_unavailable(monkeypatch):
    """(And the replica's engine settings: what its config gave, else its environment's, read
    once here and handed to the service.)"""
    from deployments.replica import MTPReplica

    monkeypatch.setenv("MTPLX_DRAFT_DRAW", "host")
    monkeypatch.setenv("MTPLX_MTP_BATCH_FORCE_WIDTH", "3")
    with process_state.restored():
        rep = MTPReplica(widths=(3,), warmup=False, engine={"force_width": None, "run_ahead": False,
                                                            "repetition_stop": {"min_tokens": 50}})
        settings = rep.service.settings
        assert (settings.draft_draw, settings.force_width, settings.run_ahead) == ("host", 3, False)
        assert settings.repetition_stop_all and settings.repetition_limits.min_tokens == 50
        rep.__del__()          # what Serve calls when it stops a replica: the service shuts down
        finals = _finals(rep, [_row(rep, 30)])
    err = finals[0]["error"]
    assert err["kind"] == "unavailable" and err["retry_after_s"] == 1.0 and "shut" in err["message"]
    with pytest.raises(RuntimeError, match="shut down"):
        rep.check_health()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="Linux: niceness per thread under /proc")
def test_serve_proxy_is_reniced_to_the_apps_niceness():
    """A process named as Ray names Serve's proxy, started at Ray's worker niceness 15, is set to
    the app's niceness (where this process may lower it; otherwise it keeps 15 and says so once);
    a proxy started after it (a restart) is found and set too."""
    import os
    import subprocess

    from deployments._proc import PROXY_PROCESS, renice_serve_proxy

    def start_proxy():
        proc = subprocess.Popen(["nice", "-n", "15", "bash", "-c", f"exec -a '{PROXY_PROCESS.decode()} fake' sleep 30"])
        deadline = time.time() + 5
        while time.time() < deadline:      # until bash has exec'd under the proxy's name
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                if f.read().startswith(PROXY_PROCESS):
                    break
            time.sleep(0.02)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 15
        return proc

    expected = 0 if os.geteuid() == 0 else 15
    first = start_proxy()
    second = None
    try:
        for _ in range(2):       # the second call looks at the proxy it found directly
            found = renice_serve_proxy(0)
            assert found.get(first.pid) == expected, found
            assert os.getpriority(os.PRIO_PROCESS, first.pid) == expected
        first.kill()
        first.wait()
        second = start_proxy()   # a restarted proxy, at Ray's 15 again
        found = renice_serve_proxy(0)
        assert first.pid not in found and found.get(second.pid) == expected, found
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity") or len(__import__("os").sched_getaffinity(0)) < 2,
                    reason="Linux CPU affinity, on a node of 2 CPUs or more")
def test_a_replica_takes_its_cpus_and_moves_its_nodes_other_processes_off():
    """`replica_cpus`: the replica's threads, those running before and those it starts after,
    run on the first CPUs of its node (its parent's, as a raylet's); the processes under the
    raylet move to the rest, model replicas excepted, the raylet itself left on every CPU; a
    count it cannot use is refused with what to set."""
    import os
    import subprocess
    import sys

    from deployments._proc import (MODEL_REPLICA_PROCESS, PROXY_PROCESS, _cmdline, _parent, move_node_processes,
                                   pin_replica_cpus)

    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, threading; from deployments._proc import pin_replica_cpus\n"
            "go = threading.Event(); seen = {}\n"
            "def look(name):\n    go.wait(); seen[name] = sorted(os.sched_getaffinity(0))\n"
            "before = threading.Thread(target=look, args=('before',)); before.start()\n"
            "got = pin_replica_cpus(1)\n"
            "after = threading.Thread(target=look, args=('after',)); after.start()\n"
            "go.set(); before.join(); after.join()\n"
            "print(list(got), seen['before'], seen['after'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == " ".join(map(str, ([allowed[:1], allowed[1:]], allowed[:1], allowed[:1]))).split(), out
    assert pin_replica_cpus(None) is None
    with pytest.raises(ValueError, match="at least 1 CPU"):
        pin_replica_cpus(0)

    model = f"ray::ServeReplica:mtplx:{MODEL_REPLICA_PROCESS.decode()}"
    names = {PROXY_PROCESS.decode(): "proxy", model: "model"}
    raylet = subprocess.Popen(["bash", "-c", '(exec -a "$P" sleep 30) & (exec -a "$M" sleep 30) & wait'],
                              env=dict(os.environ, P=PROXY_PROCESS.decode(), M=model))
    try:
        deadline, kids = time.time() + 5, {}
        while time.time() < deadline and len(kids) < 2:     # until both children run under their names
            kids = {names[t]: int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) == raylet.pid
                    for t in [_cmdline(int(e)).split(b"\0")[0].decode(errors="replace")] if t in names}
            time.sleep(0.02)
        assert set(kids) == {"proxy", "model"}, kids
        rest = allowed[1:]
        assert move_node_processes(raylet.pid, rest) == [kids["proxy"]]
        assert sorted(os.sched_getaffinity(kids["proxy"])) == rest
        assert sorted(os.sched_getaffinity(kids["model"])) == sorted(os.sched_getaffinity(raylet.pid)) == allowed
    finally:
        subprocess.run(["pkill", "-P", str(raylet.pid)])
        raylet.kill()
        raylet.wait()


def test_a_cohorts_sink_takes_each_phases_news_at_once_with_its_checkpoints():
    """The cohort's buffer is its rows' sink: one call per lane step phase, one wake. A row's
    tokens go with its checkpoint after them, so a message never carries a row's tokens past its
    last checkpoint (the ingress resumes the row elsewhere from there); tokens without one drop an
    older one. A row's first few tokens wake the stream at once (urgent); later ones may wait for
    the stream's interval. An empty hand-over wakes nothing."""
    from deployments.replica import URGENT_TOKENS, _CohortBuffer
    from mtplx.api.rows import RowCheckpoint
    from mtplx.scheduler.lane_rows import RowNews

    def cp(n):
        return RowCheckpoint(n, True, None, (0.5, True, 16, 0))

    a, b = object(), object()

    async def go():
        buf = _CohortBuffer(asyncio.get_running_loop())
        buf.row_of.update({id(a): 0, id(b): 1})

        async def woken() -> bool:
            await asyncio.sleep(0.01)     # the wake is scheduled thread-safely onto the loop
            return buf.event.is_set()

        buf([RowNews(a, list(range(URGENT_TOKENS)), None, cp(URGENT_TOKENS)), RowNews(b, [], None, cp(0))])
        assert await woken() and buf.urgent_event.is_set()       # first tokens: urgent
        tokens, _, _, checkpoints = buf.take()
        assert tokens == {0: list(range(URGENT_TOKENS))} and checkpoints == {0: cp(URGENT_TOKENS), 1: cp(0)}
        buf([RowNews(a, [7, 8], [(-0.5, ()), (-0.25, ())], cp(URGENT_TOKENS + 2))])
        assert await woken() and not buf.urgent_event.is_set()
        assert buf.take() == ({0: [7, 8]}, {0: [(-0.5, ()), (-0.25, ())]}, {}, {0: cp(URGENT_TOKENS + 2)})
        buf([RowNews(a, [4], None, cp(URGENT_TOKENS + 3))])
        buf([RowNews(a, [5], None, None)])                        # no checkpoint after 5: the older goes
        assert await woken() and buf.take() == ({0: [4, 5]}, {}, {}, {})
        buf([])
        assert not await woken()

    asyncio.run(go())


def test_streamed_rows_arrive_whole_and_before_their_ends(replica):
    from deployments.replica import URGENT_TOKENS

    rows = [dataclasses.replace(_row(replica, 40 + i, max_tokens=24), logprobs=1) for i in range(3)]

    async def go():
        msgs = []
        async for msg in replica.run_cohort(rows):
            msgs.append(msg)
        return msgs

    msgs = asyncio.run(go())
    finals = {i: f for m in msgs for i, f in (m.get("f") or {}).items()}
    for i in range(3):
        toks = [t for m in msgs for t in (m.get("t") or {}).get(i, [])]
        entries = [e for m in msgs for e in (m.get("lp") or {}).get(i, [])]
        assert toks and len(entries) == len(toks) == finals[i]["completion_tokens"]
        carrying = [k for k, m in enumerate(msgs) if i in (m.get("t") or {})]
        ended = next(k for k, m in enumerate(msgs) if i in (m.get("f") or {}))
        assert carrying[0] < ended     # streamed, not held until the row's end
        # one message per lane step at most once its first tokens are out
        assert len(carrying) <= URGENT_TOKENS + finals[i]["stats"]["verify_calls"] + 1


def test_a_stop_string_ends_its_row_at_the_replica_and_a_cancel_cancels(replica):
    """A row's stop strings are matched at the replica on its text: the row ends as a normal stop on
    the token that completed one (finish_reason "stop", not cancelled, its End carries the string),
    with no call from the ingress; a cancel ends a row cancelled, counted as one."""
    from references import greedy_ar, stop_string_in

    ids = replica.model.tokenizer.encode("def f60(x):\n", add_special_tokens=False)
    ref = greedy_ar(replica.model, ids, 60)
    stop, n = stop_string_in(replica.model.tokenizer, ref, 6)
    before = asyncio.run(replica.snapshot())
    final = _finals(replica, [_row(replica, 60, max_tokens=60, prompt_ids=ids, stop_strings=(stop,))])[0]
    assert final["completion_tokens"] == n and final["finish_reason"] == "stop"
    assert End.from_dict(final["end"]) == End(STOP_STRING, string=stop)
    assert final["stats"]["cancelled"] is False and final["stats"]["engine_finish_reason"] == "stop_string"
    after = asyncio.run(replica.snapshot())
    assert after["requests_cancelled"] == before["requests_cancelled"]

    row = _row(replica, 61, max_tokens=400)

    async def go():
        finals, cancelled = {}, None
        async for msg in replica.run_cohort([row]):
            if cancelled is None and msg.get("t"):
                cancelled = await replica.cancel(row.request_id)
            finals.update(msg.get("f") or {})
        return finals[0], cancelled

    final, live = asyncio.run(go())
    assert live == 1 and final["completion_tokens"] < 400
    assert final["finish_reason"] == "cancelled" and final["stats"]["cancelled"] is True
    assert asyncio.run(replica.snapshot())["requests_cancelled"] == after["requests_cancelled"] + 1


def test_info_reports_the_settings_in_effect(replica):
    from mtplx.scheduler.config import DEFAULT_SAMPLED_DEPTH

    info = asyncio.run(replica.info())
    # greedy depths chosen by each width's measured cycle cost
    assert info["installed_widths"] == [3] and sorted(info["greedy_depths"]) == [1, 3]
    assert set(info["greedy_depths"].values()) <= {1, 2, 3} and info["sampled_depth"] == DEFAULT_SAMPLED_DEPTH
    assert info["model_id"] == replica.model.model_id
