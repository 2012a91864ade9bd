"""The cohort service (mtplx/scheduler/service.py) against the shipped model and the real lanes.

Fake drivers appear only where a rare fault must be forced (a driver error). Jobs are queued while
the model-owner thread is held (`held_owner`), so which jobs share a cohort is deterministic.
"""

import threading
import time
from contextlib import contextmanager

import pytest

from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.installed import solo_lane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.settings import ENVIRONMENT, EngineSettings
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.sampling import SamplerConfig
from mtplx.server.mtp_batch import (MTPBatchCancelled, MTPBatchGenerationService, MTPBatchJob,
                                    MTPBatchOwnerFinalizeError, MTPBatchServiceClosed)

from references import greedy_ar

GREEDY = SamplerConfig(temperature=0.0)
FORCE_WIDTH_ENV = ENVIRONMENT["force_width"]
HOT = SamplerConfig(temperature=0.9, top_p=1.0, top_k=0)   # sampled, wide support
SNIPPETS = ["def add(a, b):\n", "import os\n", "class Node:\n", "for i in range(3):\n",
            "def main():\n    ", "x = [1, 2, 3]\n", "while True:\n", "# utils\ndef f(x):\n",
            "return None\n"]
TIMEOUT = 60


@pytest.fixture(scope="module")
def lanes(model):
    return {w: install_a3b_mtp_batch_lane(model, w) for w in (3, 8)}


@pytest.fixture
def make_service(model, lanes):
    made = []

    def make(**kwargs):
        kwargs.setdefault("batch_wait_s", 0.02)
        lanes_arg = kwargs.pop("lanes", lanes)
        service = MTPBatchGenerationService(model, lanes_arg, **kwargs)
        made.append(service)
        return service

    yield make
    for service in made:
        service.shutdown(timeout_s=30)


@pytest.fixture
def service(make_service):
    return make_service()


@pytest.fixture
def prompts(model):
    return [model.tokenizer.encode(s) for s in SNIPPETS]


@contextmanager
def held_owner(service):
    """Keep the owner thread busy so submitted jobs queue up; release on exit."""
    started, gate = threading.Event(), threading.Event()
    fut = service.call_on_owner(lambda: (started.set(), gate.wait(TIMEOUT)))
    assert started.wait(TIMEOUT)
    try:
        yield
    finally:
        gate.set()
        fut.result(TIMEOUT)


def settle(service):
    """Wait until the owner is between cohorts: rows publish at their own terminal, the
    cohort-level counters in snapshot() only when the whole cohort has ended."""
    service.call_on_owner(lambda: None).result(TIMEOUT)
    return service.snapshot()


def job(prompt, max_tokens=8, sampler=GREEDY, seed=0, rid=None, key=None, **kw):
    return MTPBatchJob(request_id=rid or f"req-{seed}", prompt_ids=prompt, max_tokens=max_tokens,
                       sampler=sampler, seed=seed, stop_token_ids=kw.pop("stop_token_ids", ()),
                       compatibility_key=key or ("tiny", False, sampler, None), **kw)


def run_held(service, jobs):
    with held_owner(service):
        futures = [service.submit(j) for j in jobs]
    return [f.result(TIMEOUT) for f in futures]


# ------------------------------------------------------------------------------ seed examples


def test_seed_example_create_job_and_read_stats(model, capsys):
    service = MTPBatchGenerationService.for_model(model, widths=(3, 8), batch_wait_s=0.02)
    try:
        sampler = SamplerConfig(temperature=0.7)   # the example's key refers to these two names
        draft_sampler = SamplerConfig()
        # --- seed example 1, as written
        job = MTPBatchJob(
            request_id="mtpbatch-1234",
            prompt_ids=[101, 102, 103],
            max_tokens=256,
            sampler=SamplerConfig(temperature=0.7),
            draft_sampler=SamplerConfig(),
            seed=42,
            stop_token_ids={0},
            token_callback=lambda toks: print("token:", toks),
            compatibility_key=("my-model", False, sampler, draft_sampler),
            generation_limits={},
            solo_runner=None,
            cancel_error=lambda j: RuntimeError("cancelled"),
        )
        future = service.submit(job)
        # --- seed example 3, as written
        result = future.result()
        stats = result["stats"]
        print(f"Decode time: {stats['decode_elapsed_s']:.3f}s")
        print(f"Tokens per second: {stats['decode_tok_s']:.1f}")
        print(f"Fixed width used: {stats['mtp_batch_fixed_width']}")
    finally:
        service.shutdown()
    out = capsys.readouterr().out.splitlines()
    streamed = [line for line in out if line.startswith("token: [")]
    non_stop = [t for t in result["tokens"] if t != 0]
    assert streamed == [f"token: [{t}]" for t in non_stop]
    # generation_mode "auto" (the default): the one-row lane's own draws, with the row's drafting
    # policy (generate_mtpk is a forced "mtp" row of the same lane)
    alone = generate_a3b_mtp_batch(solo_lane(model), [A3BMTPBatchRequest(
        request_id="r", prompt_ids=[101, 102, 103], max_tokens=256, sampler=SamplerConfig(temperature=0.7),
        draft_sampler=SamplerConfig(), seed=42, stop_token_ids={0}, adaptive=True)])
    assert result["tokens"] == alone.streams[0].tokens and stats["generation_mode"] == "auto"
    assert "Fixed width used: 1" in out
    assert stats["decode_elapsed_s"] > 0 and stats["decode_tok_s"] > 0
    assert service.snapshot()["installed_widths"] == [3, 8]


def test_seed_example_server_path_job(model, service):
    """Seed example 2 (the server excerpt) verbatim, with the server's names stood in locally."""
    import uuid

    class _StreamCancelled(Exception):
        pass

    def _default_stop_tokens(tokenizer):
        return set(model.eos_token_ids)

    def _mtp_batch_compatibility_key(lane, omit, sampler, draft_sampler):
        return (lane, omit, sampler, draft_sampler)

    def _run_generation(state, prompt_ids, **solo_kwargs):
        r = generate_mtpk(state.model, prompt_ids, **solo_kwargs)
        return {"tokens": r.tokens, "finish_reason": r.finish_reason, "stats": r.stats}

    class state:
        runtime = model
    state.model = model
    prefill_events = []
    kwargs = {"token_callback": lambda toks: None, "prefill_callback": prefill_events.append,
              "session_id": "s-1"}
    response_id, prompt_ids, response_max = None, model.tokenizer.encode("def main():\n"), 12
    sampler, draft_sampler, generation_seed, omit_bonus, lane = GREEDY, None, 7, False, "mtp_batch"
    generation_limits, cancel_event, request_observability = {}, threading.Event(), {"client": "t"}
    session_restore_hook = session_commit_hook = None
    solo_kwargs = {"max_tokens": response_max, "sampler": sampler, "seed": generation_seed,
                   "stop_token_ids": _default_stop_tokens(model.tokenizer)}

    job = MTPBatchJob(
        request_id=response_id or f"mtpbatch-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        max_tokens=response_max,
        sampler=sampler,
        draft_sampler=draft_sampler,
        seed=generation_seed,
        stop_token_ids=_default_stop_tokens(state.runtime.tokenizer),
        token_callback=kwargs.get("token_callback"),
        prefill_callback=kwargs.get("prefill_callback"),
        compatibility_key=_mtp_batch_compatibility_key(lane, omit_bonus, sampler, draft_sampler),
        generation_limits=generation_limits,
        solo_runner=lambda _job: _run_generation(state, prompt_ids, **solo_kwargs),
        cancel_error=lambda item: _StreamCancelled(f"request {item.request_id} cancelled"),
        cancel_event=cancel_event,
        request_observability=request_observability,
        omit_speculative_bonus=omit_bonus,
        session_id=kwargs.get("session_id"),
        session_restore=session_restore_hook,
        session_commit=session_commit_hook,
    )
    result = service.submit(job).result(TIMEOUT)
    assert result["tokens"] == generate_ar(model, prompt_ids, response_max, GREEDY,
                                           stop_token_ids=model.eos_token_ids).tokens
    assert result["_mtp_batch_solo"] is True
    assert result["stats"]["client"] == "t" and result["stats"]["scheduler_policy"] == "solo_mtp"
    assert [e["phase"] for e in prefill_events] == ["started", "completed"]


# ------------------------------------------------------------------------------ widths and lanes


@pytest.mark.parametrize("n, fixed", [(2, 3), (5, 8)])
def test_width_choice_narrowest_lane_that_fits(model, service, lanes, prompts, n, fixed):
    # generation_mode "mtp": every cycle drafts, whatever the cycle costs measured on a loaded machine
    # ("auto" rows may step aside to AR steps, which never run ahead)
    jobs = [job(prompts[i], max_tokens=6 + 3 * i, seed=i, adaptive=False) for i in range(n)]
    results = run_held(service, jobs)
    for i, r in enumerate(results):
        s = r["stats"]
        assert (s["mtp_batch_real_width"], s["mtp_batch_fixed_width"]) == (n, fixed)
        assert s["scheduler_policy"] == f"fixed_mtp_batch_width_{fixed}"
        assert s["mtp_batch_route_id"] == lanes[fixed].route_id
        assert r["_mtp_batch_solo"] is False
        # greedy cohort rows equal plain AR (exactness through the service wiring)
        assert r["tokens"] == greedy_ar(model, prompts[i], 6 + 3 * i)
    snap = settle(service)
    assert snap["lanes_started"] == 1 and snap["admissions"] == n and snap["lanes"] == []
    assert 0 < snap["ahead_cycles"] <= snap["mtp_cycles"]      # a greedy lane runs ahead between boundaries
    assert snap["context_drafts"] == 0                           # off by default
    assert snap["last_fixed_width"] == fixed
    assert snap["last_route_id"] == lanes[fixed].route_id
    assert set(snap["fixed_width_histogram"]) == {str(fixed)}
    assert snap["target_verify_cycles"] == snap["fixed_width_histogram"][str(fixed)] > 0


def test_force_width_from_the_entry_points_environment(monkeypatch, make_service, prompts):
    """MTPLX_MTP_BATCH_FORCE_WIDTH reaches the service through the settings an entry point builds
    (the service itself reads no environment)."""
    monkeypatch.setenv(FORCE_WIDTH_ENV, "3")
    service = make_service()
    assert service.snapshot()["forced_width"] is None
    service = make_service(settings=EngineSettings.from_environ({FORCE_WIDTH_ENV: "8"}))
    assert service.snapshot()["forced_width"] == 8
    results = run_held(service, [job(prompts[i], seed=i) for i in range(2)])
    assert {r["stats"]["mtp_batch_fixed_width"] for r in results} == {8}

    service = make_service(settings=EngineSettings.from_environ({FORCE_WIDTH_ENV: "3"}))
    results = run_held(service, [job(prompts[i], seed=i) for i in range(5)])   # 3 does not fit 5
    assert {r["stats"]["mtp_batch_fixed_width"] for r in results} == {8}
    results = run_held(service, [job(prompts[i], seed=i) for i in range(2)])
    assert {r["stats"]["mtp_batch_fixed_width"] for r in results} == {3}


@pytest.mark.parametrize("value, named", [("5", "force_width=5 is not an installed width"),
                                          ("eight", FORCE_WIDTH_ENV + "='eight' is invalid")])
def test_force_width_env_must_name_an_installed_width(make_service, value, named):
    with pytest.raises(ValueError, match=named):
        make_service(settings=EngineSettings.from_environ({FORCE_WIDTH_ENV: value}))


def test_ninth_row_joins_the_running_b8_lane_when_a_slot_frees(model, service, prompts):
    budgets = [4, 40, 40, 40, 40, 40, 40, 40, 12]
    jobs = [job(prompts[i], max_tokens=budgets[i], seed=i, rid=f"r{i}") for i in range(9)]
    results = run_held(service, jobs)
    assert [r["stats"]["mtp_batch_fixed_width"] for r in results] == [8] * 9
    # the ninth waited for row 0's slot, then decoded beside the other seven (no second cohort)
    assert jobs[8].admitted_s >= jobs[0].completed_s
    assert jobs[8].decode_started_s < min(j.completed_s for j in jobs[1:8])
    assert results[8]["stats"]["admitted_at_cycle"] > 0
    assert results[8]["stats"]["lane_mean_occupancy"] > 6
    for i, r in enumerate(results):
        assert r["tokens"] == greedy_ar(model, prompts[i], budgets[i])
    snap = settle(service)
    assert snap["lanes_started"] == 1 and snap["admissions"] == 9 and set(snap["fixed_width_histogram"]) == {"8"}


def test_different_keys_run_side_by_side(service, prompts):
    kinds = [GREEDY, HOT, GREEDY, HOT, GREEDY]
    jobs = [job(prompts[i], max_tokens=30, sampler=s, seed=i) for i, s in enumerate(kinds)]
    results = run_held(service, jobs)
    greedy_rows = [r for r, s in zip(results, kinds) if s is GREEDY]
    hot_rows = [r for r, s in zip(results, kinds) if s is HOT]
    assert {r["stats"]["mtp_batch_real_width"] for r in greedy_rows} == {3}
    assert {r["stats"]["mtp_batch_real_width"] for r in hot_rows} == {2}
    # the two keys' lanes take turns cycle by cycle: neither waits for the other to drain
    assert max(jobs[i].decode_started_s for i in (1, 3)) < min(jobs[i].completed_s for i in (0, 2, 4))
    assert settle(service)["lanes_started"] == 2


def test_submit_cohort_splits_by_key_without_waiting(make_service, prompts):
    service = make_service(batch_wait_s=5.0)     # a gather wait would show in the timing
    kinds = [GREEDY, HOT, GREEDY, HOT, GREEDY]
    jobs = [job(prompts[i], max_tokens=4, sampler=s, seed=i) for i, s in enumerate(kinds)]
    t0 = time.perf_counter()
    futures = service.submit_cohort(jobs)
    results = [f.result(TIMEOUT) for f in futures]
    assert time.perf_counter() - t0 < 5.0
    assert [r["stats"]["mtp_batch_real_width"] for r in results] == [3, 2, 3, 2, 3]
    assert settle(service)["lanes_started"] == 2


def test_one_job_runs_the_solo_mtp_path(model, service, prompts):
    j = job(prompts[0], max_tokens=16, sampler=HOT, seed=5, adaptive=False)    # "mtp": drafts every cycle
    r = service.submit(j).result(TIMEOUT)
    ref = generate_mtpk(model, prompts[0], 16, HOT, seed=5)
    assert r["tokens"] == ref.tokens
    s = r["stats"]
    assert (s["mtp_batch_real_width"], s["mtp_batch_fixed_width"]) == (1, 1)
    assert s["scheduler_policy"] == "solo_mtp" and s["scheduler_lane"] == "mtp_batch"
    assert (s["accepted_drafts"], s["rejected_drafts"], s["verify_calls"]) == (
        ref.stats["accepted_drafts"], ref.stats["rejected_drafts"], ref.stats["verify_calls"])
    assert service.snapshot()["solo_runs"] == 1


def test_b1_exact_runs_every_job_serially_in_the_one_row_lane(model, prompts):
    """b1-exact: rows decode one at a time in the one-row lane, with the solo path's tokens; a job
    with its own solo runner runs through it, and its failure stays its own."""
    service = MTPBatchGenerationService.for_model(model, numerics="b1-exact")
    try:
        def boom(_job):
            raise RuntimeError("solo runner broke")
        jobs = [job(prompts[i], max_tokens=10, sampler=HOT, seed=i) for i in range(3)]
        jobs.append(job(prompts[3], sampler=HOT, seed=3, solo_runner=boom))
        with held_owner(service):
            futures = [service.submit(j) for j in jobs]
        for i, f in enumerate(futures[:3]):
            r = f.result(TIMEOUT)
            assert r["tokens"] == generate_mtpk(model, prompts[i], 10, HOT, seed=i).tokens
            s = r["stats"]
            assert s["scheduler_policy"] == "serial_b1_exact"
            assert s["scheduler_lane"] == "mtp_batch_b1_exact" and s["mtp_batch_numerics"] == "b1-exact"
            assert (s["mtp_batch_real_width"], s["mtp_batch_fixed_width"]) == (1, 1)
        with pytest.raises(RuntimeError, match="solo runner broke"):
            futures[3].result(TIMEOUT)
        # serial: each job's decode started after the previous one finished
        for a, b in zip(jobs[:2], jobs[1:3]):
            assert b.decode_started_s > a.completed_s
        snap = settle(service)
        assert snap["installed_widths"] == [] and snap["solo_runs"] == 4
        assert set(snap["fixed_width_histogram"]) == {"1"} and snap["shut_down"] is False
    finally:
        service.shutdown()


# ------------------------------------------------------------------------------ cancellation


def test_cancel_before_admission_fails_at_once(service, prompts):
    sentinel = ValueError("client went away")
    a = job(prompts[0], seed=0, cancel_error=lambda j: sentinel)
    b = job(prompts[1], seed=1)
    c = job(prompts[2], seed=2)
    with held_owner(service):
        fa, fb, fc = service.submit(a), service.submit(b), service.submit(c)
        a.cancel()
        # failed while the owner is still held: never admitted, no MLX work happened
        assert fa.done() and fa.exception() is sentinel
        c.cancel_event.set()              # cancelled behind the service's back: dropped leaving the queue
    assert fb.result(TIMEOUT)["stats"]["mtp_batch_real_width"] == 1
    assert isinstance(fc.exception(TIMEOUT), MTPBatchCancelled)
    assert a.tokens == [] and c.tokens == []
    pre = job(prompts[3], seed=3)
    pre.cancel_event.set()
    assert isinstance(service.submit(pre).exception(TIMEOUT), MTPBatchCancelled)


def _cohort(prompts, n, max_tokens, sampler=HOT, per_row=None):
    per_row = per_row or {}
    jobs = []
    for i in range(n):
        kw = per_row.get(i, {})
        jobs.append(job(prompts[i], max_tokens=max_tokens[i], sampler=sampler, seed=100 + i, rid=f"r{i}", **kw))
    return jobs


def test_cancel_mid_cohort_drops_row_peers_unaffected(service, prompts):
    budgets = [40, 120, 40, 40]
    undisturbed = run_held(service, _cohort(prompts, 4, budgets))
    reached, cancelled = threading.Event(), threading.Event()
    seen = []

    def cb(toks):
        seen.extend(toks)
        if len(seen) == 5:
            reached.set()
            assert cancelled.wait(TIMEOUT)    # hold the owner until the request thread cancels

    jobs = _cohort(prompts, 4, budgets, per_row={1: {"token_callback": cb}})
    with held_owner(service):
        futures = [service.submit(j) for j in jobs]
    assert reached.wait(TIMEOUT)
    jobs[1].cancel()                      # from this (request) thread, mid-decode
    assert futures[1].done()
    cancelled.set()
    assert isinstance(futures[1].exception(), MTPBatchCancelled)
    results = [f.result(TIMEOUT) for i, f in enumerate(futures) if i != 1]
    for i, r in zip((0, 2, 3), results):
        assert r["tokens"] == undisturbed[i]["tokens"]
        assert r["stats"]["mtp_batch_real_width"] == 4
    # nothing is recorded after the cancel; what was emitted is the undisturbed prefix
    assert jobs[1].tokens == seen == undisturbed[1]["tokens"][:5]
    assert service.snapshot()["requests_cancelled"] == 1


def test_callback_error_stays_row_local(service, prompts):
    budgets = [30, 30, 30]
    undisturbed = run_held(service, _cohort(prompts, 3, budgets))
    err = KeyError("socket closed")
    calls = []

    def bad(toks):
        calls.append(toks)
        if len(calls) == 3:
            raise err

    jobs = _cohort(prompts, 3, budgets, per_row={0: {"token_callback": bad}})
    with held_owner(service):
        futures = [service.submit(j) for j in jobs]
    assert futures[0].exception(TIMEOUT) is err
    assert len(calls) == 3 and jobs[0].callback_error is err
    for i in (1, 2):
        assert futures[i].result(TIMEOUT)["tokens"] == undisturbed[i]["tokens"]
    snap = service.snapshot()
    assert snap["last_error"] is None and snap["driver_errors"] == 0


# ------------------------------------------------------------------------------ faults


def test_a_lane_error_fails_nobody(make_service, prompts):
    """A fault nobody is blamed for (the lane's step raised): its rows resume in a rebuilt lane
    and finish as they would have (tests/test_faults.py forces the row-level faults)."""
    from mtplx.engine.lane import RunningLane

    broken = []

    class FlakyLane(RunningLane):
        def decode(self):
            if not broken and self.counters.cycles == 2:
                broken.append(self.live_rows)
                raise RuntimeError("device lost")
            return super().decode()

    first = [job(prompts[i], max_tokens=20, sampler=GREEDY, seed=i) for i in range(3)]
    undisturbed = run_held(make_service(), first)
    service = make_service(running_lane_cls=FlakyLane)
    first = [job(prompts[i], max_tokens=20, sampler=GREEDY, seed=i) for i in range(3)]
    with held_owner(service):
        futures = [service.submit(j) for j in first]
    assert [f.result(TIMEOUT)["tokens"] for f in futures] == [r["tokens"] for r in undisturbed]
    second = [job(prompts[i], sampler=HOT, seed=i) for i in range(3, 5)]
    for f in service.submit_cohort(second):
        assert f.result(TIMEOUT)["finish_reason"] == "length"
    snap = settle(service)
    assert broken == [3]
    assert snap["last_error"] == "RuntimeError: device lost" and snap["driver_errors"] == 1
    assert snap["lanes_rebuilt"] == 1 and snap["rows_failed"] == 0
    assert snap["shut_down"] is False and snap["active"] == 0 and snap["lanes"] == []
    assert service.submit(job(prompts[0])).result(TIMEOUT)["finish_reason"] == "length"


@pytest.mark.parametrize("finalize_kind", ["raises", "not_cleared"])
def test_owner_finalize_failure_poisons_the_service(make_service, prompts, finalize_kind):
    def finalize(jobs):
        if finalize_kind == "raises":
            raise OSError("cache cleanup failed")
        return {"mlx_cache_cleanup": {"cleared": False}}

    service = make_service(owner_finalize=finalize)
    cohort = [job(prompts[i], seed=i) for i in range(2)]
    other_key = job(prompts[2], max_tokens=400, sampler=HOT, seed=2)   # still running at the poisoning
    with held_owner(service):
        futures = [service.submit(j) for j in cohort + [other_key]]
    for f in futures[:2]:   # rows already published at their terminal keep their results
        assert f.result(TIMEOUT)["finish_reason"] == "length"
    with pytest.raises(MTPBatchOwnerFinalizeError, match="owner finalize failed"):
        futures[2].result(TIMEOUT)
    later = service.submit(job(prompts[3]))
    with pytest.raises(MTPBatchOwnerFinalizeError):
        later.result(TIMEOUT)
    snap = service.snapshot()
    assert snap["shut_down"] and snap["poisoned"].startswith("MTP batch owner finalize failed")
    assert snap["pending"] == 0


def test_shutdown_fails_pending_cancels_active_and_refuses_new_work(service, prompts):
    reached = threading.Event()
    active = job(prompts[0], max_tokens=400, seed=0, token_callback=lambda t: reached.set())
    peer = job(prompts[1], max_tokens=400, seed=1)
    fa, fp = service.submit_cohort([active, peer])
    assert reached.wait(TIMEOUT)
    waiting = job(prompts[2], sampler=HOT, seed=2)
    fw = service.submit(waiting)
    service.shutdown(timeout_s=30)
    assert isinstance(fa.exception(), MTPBatchCancelled) and isinstance(fp.exception(), MTPBatchCancelled)
    assert len(active.tokens) < 400
    assert isinstance(fw.exception(), MTPBatchServiceClosed) and waiting.tokens == []
    late = service.submit(job(prompts[3]))
    with pytest.raises(MTPBatchServiceClosed, match="shut down"):
        late.result(1)
    snap = service.snapshot()
    assert snap["shut_down"] and not snap["owner_alive"] and snap["active"] == 0


def test_shutdown_times_out_when_the_owner_is_stuck(make_service):
    service = make_service()
    started, gate = threading.Event(), threading.Event()
    service.call_on_owner(lambda: (started.set(), gate.wait(TIMEOUT)))
    assert started.wait(TIMEOUT)
    try:
        with pytest.raises(RuntimeError, match="owner did not finalize active requests"):
            service.shutdown(timeout_s=0.2)
    finally:
        gate.set()
    service.shutdown(timeout_s=30)
    assert not service.snapshot()["owner_alive"]


def test_duplicate_request_ids_keep_rows_apart(model, service, prompts):
    streams = {i: [] for i in range(3)}
    jobs = [job(prompts[i], max_tokens=10, seed=i, rid="same-id",
                token_callback=lambda toks, i=i: streams[i].extend(toks)) for i in range(3)]
    results = run_held(service, jobs)
    for i, r in enumerate(results):
        assert r["request_id"] == "same-id" and r["stats"]["mtp_batch_real_width"] == 3
        ref = greedy_ar(model, prompts[i], 10)
        assert r["tokens"] == ref and streams[i] == ref


def test_a_cohorts_sink_gets_each_phases_news_in_one_call_before_its_rows_resolve(model, make_service, prompts):
    """Jobs sharing a sink: per lane step phase one call with the news of every row that has any
    (tokens, entries when asked, the checkpoint after them), each row's news before its future
    resolves; the tokens shown are the result's less a stop token; no token callback is called.
    A raising sink fails its own rows only."""
    service = make_service()
    calls = []

    def sink(news):
        calls.append([(n.job.request_id, list(n.tokens), n.logprobs, n.checkpoint, n.job.future.done())
                      for n in news])

    eos = prompts[0][-1]
    jobs = [job(prompts[i], max_tokens=12, seed=i, rid=f"s{i}", sink=sink, logprobs=0 if i == 1 else None,
                stop_token_ids={eos} if i == 2 else (), token_callback=lambda toks: pytest.fail("not for sunk jobs"))
            for i in range(3)]
    results = run_held(service, jobs)
    assert calls and all(len({rid for rid, *_ in c}) == len(c) for c in calls)     # a row once per call
    assert not any(done for c in calls for *_, done in c)                        # before it resolved
    for j, r in zip(jobs, results):
        mine = [(toks, lps, cp) for c in calls for rid, toks, lps, cp, _ in c if rid == j.request_id]
        shown = [t for toks, _, _ in mine for t in toks]
        assert shown == [t for t in r["tokens"] if t not in j.stop_token_ids]
        assert all((lps is not None) == (j.logprobs is not None) for toks, lps, _ in mine if toks)
        assert [cp.tokens for _, _, cp in mine if cp is not None] == sorted(cp.tokens for _, _, cp in mine if cp)

    def broken(news):
        raise RuntimeError("sink down")

    bad = [job(prompts[i], max_tokens=12, seed=i, rid=f"b{i}", sink=broken) for i in range(2)]
    good = job(prompts[2], max_tokens=12, seed=2, rid="g", sink=sink)
    futures = run_held_futures(service, bad + [good])
    for f in futures[:2]:
        with pytest.raises(RuntimeError, match="sink down"):
            f.result(TIMEOUT)
    assert futures[2].result(TIMEOUT)["tokens"] == greedy_ar(model, prompts[2], 12)     # undisturbed


def test_submit_rejects_unrunnable_jobs_alone(model, service, prompts):
    bad_empty = job([], seed=1)
    bad_ctx = job(prompts[0], max_tokens=model.max_context, seed=2)
    good = [job(prompts[i], seed=i) for i in range(2)]
    futures = service.submit_cohort([bad_empty] + good + [bad_ctx])
    with pytest.raises(ValueError, match="empty"):
        futures[0].result(TIMEOUT)
    with pytest.raises(ValueError, match="context window"):
        futures[3].result(TIMEOUT)
    assert [f.result(TIMEOUT)["stats"]["mtp_batch_real_width"] for f in futures[1:3]] == [2, 2]
    with pytest.raises(ValueError, match="already submitted"):
        service.submit(good[0])


# ------------------------------------------------------------------------------ stats contract


def _check_timing(j, r):
    s = r["stats"]
    n = len(j.tokens)
    assert r["completion_tokens"] == s["completion_tokens"] == n == len(r["tokens"])
    assert r["prompt_tokens"] == len(j.prompt_ids)
    assert j.created_s <= j.admitted_s <= j.decode_started_s <= j.completed_s
    assert s["queue_wait_s"] == pytest.approx(j.admitted_s - j.created_s)
    assert s["prompt_eval_time_s"] >= 0
    decode_end = j.decode_started_s + s["decode_elapsed_s"]
    assert j.decode_started_s < decode_end <= j.completed_s
    assert all(j.decode_started_s <= t <= decode_end for t in j.token_times)
    assert s["decode_elapsed_s"] <= s["request_elapsed_s"]
    assert s["request_elapsed_s"] == pytest.approx(j.completed_s - j.created_s, abs=1e-3)
    assert s["decode_tok_s"] == pytest.approx(n / s["decode_elapsed_s"], rel=1e-12)
    assert s["end_to_end_tok_s"] == pytest.approx(n / s["request_elapsed_s"], rel=1e-12)
    assert s["decode_tok_s"] >= s["end_to_end_tok_s"]
    assert s["finish_reason"] == r["finish_reason"] and s["generation_mode"] == j.generation_mode == "auto"


def test_stats_timing_invariants_and_observability_merge(model, service, prompts, lanes):
    obs = [{"scheduler_policy": "estimate", "mtp_batch_fixed_width": 0, "client": f"c{i}"}
           for i in range(4)]
    stop = set(model.eos_token_ids)
    jobs = [job(prompts[i], max_tokens=12 + 6 * i, sampler=HOT, seed=i, request_observability=obs[i],
                stop_token_ids=stop) for i in range(3)]
    results = run_held(service, jobs)
    for i, (j, r) in enumerate(zip(jobs, results)):
        _check_timing(j, r)
        s = r["stats"]
        assert s["scheduler_lane"] == "mtp_batch" and s["client"] == f"c{i}"
        assert s["scheduler_policy"] == obs[i]["scheduler_policy"] == "fixed_mtp_batch_width_3"
        assert s["mtp_batch_fixed_width"] == obs[i]["mtp_batch_fixed_width"] == 3
        assert obs[i]["mtp_batch_route_id"] == lanes[3].route_id
        assert s["verify_calls"] >= 1
        assert s["accepted_drafts"] + s["rejected_drafts"] <= s["verify_calls"]
        assert r["_mtp_batch_stop_token_ids"] == sorted(stop)
        assert (r["finish_reason"], r["tokens"][-1] in stop) in {("stop", True), ("length", False)}
    snap = settle(service)
    assert snap["accepted_draft_tokens"] == sum(r["stats"]["accepted_drafts"] for r in results)
    assert snap["rejected_draft_tokens"] == sum(r["stats"]["rejected_drafts"] for r in results)
    solo = job(prompts[5], max_tokens=9, seed=9, request_observability=obs[3])
    r = service.submit(solo).result(TIMEOUT)
    _check_timing(solo, r)
    assert obs[3]["scheduler_policy"] == "solo_mtp" and obs[3]["mtp_batch_fixed_width"] == 1


def test_short_row_resolves_before_long_neighbour(service, prompts):
    short = job(prompts[0], max_tokens=3, seed=0)
    long = job(prompts[1], max_tokens=150, seed=1)
    fs, fl = run_held_futures(service, [short, long])
    rs = fs.result(TIMEOUT)
    rl = fl.result(TIMEOUT)
    assert rs["stats"]["mtp_batch_real_width"] == rl["stats"]["mtp_batch_real_width"] == 2
    # published at its own terminal, while the neighbour still had most of its tokens to go
    assert short.completed_s < long.token_times[10]
    _check_timing(short, rs)
    _check_timing(long, rl)


def run_held_futures(service, jobs):
    with held_owner(service):
        return [service.submit(j) for j in jobs]


# ------------------------------------------------------------------------------ hand-over hooks


def test_call_on_owner_runs_on_the_model_owner_thread(service):
    assert service.call_on_owner(lambda: threading.current_thread().name).result(TIMEOUT) == \
        "mtplx-model-owner"


def test_session_hooks_are_passed_through_and_fail_safe(service, prompts):
    budgets = [12, 12, 12]
    undisturbed = run_held(service, _cohort(prompts, 3, budgets))
    restores = []

    def broken_restore():
        restores.append(1)
        raise RuntimeError("bank corrupted")

    def broken_commit(*args, **kwargs):
        raise RuntimeError("bank full")

    hooks = {"session_restore": broken_restore, "session_commit": broken_commit, "session_id": "s"}
    jobs = _cohort(prompts, 3, budgets, per_row={0: hooks, 2: dict(hooks)})
    results = run_held(service, jobs)
    assert len(restores) == 2                      # once per row that has a hook
    for r, ref in zip(results, undisturbed):
        assert r["tokens"] == ref["tokens"] and r["cached_tokens"] == 0


def test_pump_once_without_owner_thread(make_service, prompts):
    service = make_service(start=False)
    jobs = [job(prompts[i], seed=i) for i in range(3)] + [job(prompts[3], sampler=HOT, seed=3)]
    futures = [service.submit(j) for j in jobs]
    assert service.snapshot()["pending"] == 4 and not any(f.done() for f in futures)
    assert service.pump_once() is True            # the head key's three, no gather wait
    assert [f.done() for f in futures] == [True, True, True, False]
    assert service.pump_once() is True and futures[3].result(0)["stats"]["mtp_batch_real_width"] == 1
    assert service.pump_once() is False


def test_a_refused_lane_width_serves_solo_with_the_reason(model, prompts, monkeypatch):
    """A lane whose self-check fails is not installed; the service still starts, names the failed
    check in its snapshot, and decodes that width's rows through the one-row lane (exactly)."""
    import mtplx.engine.install as install_mod

    real = install_mod.run_selfcheck
    monkeypatch.setattr(install_mod, "run_selfcheck", lambda lane: real(lane) if lane.width != 8 else {
        "ok": False, "failures": ["row_isolation: injected fault"], "failed_checks": ["row_isolation"]})
    service = MTPBatchGenerationService.for_model(model, widths=(8,), batch_wait_s=0.01)
    try:
        snap = service.snapshot()
        assert snap["installed_widths"] == [] and "failed self-check row_isolation" in snap["refused_widths"]["8"]
        results = [f.result(TIMEOUT) for f in [service.submit(job(prompts[i], seed=i)) for i in range(3)]]
        for r, p in zip(results, prompts):
            assert r["tokens"] == greedy_ar(model, p, 8)
            assert r["stats"]["mtp_batch_fixed_width"] == 1
        service.install_lanes([3]).result(TIMEOUT)
        assert service.snapshot()["selfchecks"]["3"] == {"ok": True, "dtype": "float32", "parity_tolerance": 0.0,
                                                         "tolerated_divergences": []}
        assert service.snapshot()["compiled_graphs"] == {"3": True}   # compiled by default, none disagreed
    finally:
        service.shutdown(timeout_s=30)


def test_idle_owner_returns_free_heap_once_per_busy_spell(service, prompts, monkeypatch):
    """After work, an owner idle for IDLE_HEAP_RELEASE_S hands the C heap's free pages back to the
    OS (once; not again while it stays idle), and never while rows decode."""
    import mtplx.scheduler.owner as mb
    from mtplx.runtime import release_free_heap

    assert release_free_heap() is True          # glibc: the real call works here
    calls = []

    def counting():
        calls.append(bool(service._running))    # a lane still running
        return release_free_heap()

    monkeypatch.setattr(mb, "release_free_heap", counting)
    for _ in range(2):
        service.submit(job(prompts[0], max_tokens=24)).result(TIMEOUT)
        deadline = time.monotonic() + 10 * mb.IDLE_HEAP_RELEASE_S
        n = len(calls)
        while len(calls) == n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) == n + 1
        time.sleep(3 * mb.IDLE_HEAP_RELEASE_S)
        assert len(calls) == n + 1               # idle on: no second release
    assert not any(calls)


def test_greedy_keys_chain_deeper_drafts_where_configured_sampled_keys_do_not(model, make_service, prompts):
    """greedy_depths={1: 3, 3: 2}: a lone greedy row chains 3 drafts a cycle, three greedy rows 2,
    tokens equal to plain greedy decoding either way; a lone sampled row keeps depth 1 (its draws
    are generate_mtpk's at depth 1, whoever its neighbours are)."""
    service = make_service(greedy_depths={1: 3, 3: 2})
    service.install_lanes([3]).result(TIMEOUT)        # B3 is installed: only the deeper greedy lanes
    # generation_mode "mtp" (not "auto"): every cycle drafts, whatever the costs a loaded machine measures
    alone = service.submit(job(prompts[0], max_tokens=40, seed=1, rid="alone", adaptive=False)).result(TIMEOUT)
    assert alone["tokens"] == greedy_ar(model, prompts[0], 40)
    assert alone["stats"]["mtp_depth"] == 3 and alone["stats"]["mtp_batch_fixed_width"] == 1
    three = run_held(service, [job(prompts[i], max_tokens=30, seed=i, rid=f"g{i}", adaptive=False) for i in (1, 2, 3)])
    for i, r in zip((1, 2, 3), three):
        assert r["tokens"] == greedy_ar(model, prompts[i], 30)
        assert r["stats"]["mtp_depth"] == 2 and r["stats"]["mtp_batch_fixed_width"] == 3
        assert r["stats"]["mtp_batch_route_id"] == three[0]["stats"]["mtp_batch_route_id"]
    hot = service.submit(job(prompts[4], max_tokens=24, sampler=HOT, seed=7, adaptive=False)).result(TIMEOUT)
    assert hot["tokens"] == generate_mtpk(model, prompts[4], 24, HOT, seed=7).tokens
    assert hot["stats"]["mtp_depth"] == 1
    snap = settle(service)
    assert sum(snap["accepted_by_position"]) == snap["accepted_draft_tokens"] and snap["accepted_by_position"][2] > 0
    assert snap["draft_proposals"] < snap["draft_tokens"] <= 3 * snap["draft_proposals"]


def test_greedy_depths_by_cost_keep_being_chosen_as_the_lane_runs(model, make_service, prompts):
    """greedy_depths "cost" (the app's null): a key's running lane gets every installed depth to
    choose from and chooses greedy rows' depth at their acceptance in it, which it measures; their
    tokens equal plain greedy decoding."""
    from mtplx.engine.lane import RunningLane

    made = []

    class Recorded(RunningLane):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    service = make_service(greedy_depths="cost", running_lane_cls=Recorded)
    service.install_lanes([3]).result(TIMEOUT)
    three = run_held(service, [job(prompts[i], max_tokens=30, seed=i, rid=f"g{i}") for i in (1, 2, 3)])
    for i, r in zip((1, 2, 3), three):
        assert r["tokens"] == greedy_ar(model, prompts[i], 30)
        assert r["stats"]["mtp_depth"] in (1, 2, 3) and r["stats"]["mtp_batch_fixed_width"] == 3
    assert made and all(running.shapes.depth_by_cost for running in made)
    running = made[-1]
    assert set(running.shapes.lanes_at[3]) == {1, 2, 3}
    assert running.counters.greedy_first_drafts > 0 and 0.0 < running.greedy_acceptance() <= 1.0


@pytest.mark.parametrize("depths", [{3: 4}, {0: 2}, {3: True}, {64: 1}])
def test_greedy_depths_are_checked(make_service, depths):
    with pytest.raises(ValueError, match="greedy_depths"):
        make_service(greedy_depths=depths)


# ------------------------------------------------------------------------------ settings and stops


def test_force_width_setting_names_itself(make_service, prompts):
    service = make_service(settings=EngineSettings(force_width=8))
    results = run_held(service, [job(prompts[i], seed=i) for i in range(2)])
    assert {r["stats"]["mtp_batch_fixed_width"] for r in results} == {8}
    with pytest.raises(ValueError, match="force_width=5 is not an installed width"):
        make_service(settings=EngineSettings(force_width=5))


@pytest.mark.parametrize("settings, named", [(lambda: {"settings": EngineSettings(draft_draw="gpu")}, "draft_draw="),
                                            (lambda: {"numerics": "fast", "lanes": {}}, "numerics=")])
def test_settings_are_checked_at_construction(make_service, settings, named):
    with pytest.raises(ValueError, match=named):
        make_service(**settings())


def test_a_stop_string_ends_its_row_in_the_step_that_completed_it(service, model, prompts):
    """A job's stop string, matched on its text as it decodes: the row ends on the token that
    completed it (its last), resolves as a stop, not a cancellation; its neighbour is undisturbed."""
    from functools import partial

    from mtplx.api.text import StopStringWatch
    from references import stop_string_in

    prompts = prompts[3:]        # the first row's text varies (some of the shipped model's repeat one line)
    undisturbed = run_held(service, _cohort(prompts, 2, [60, 60], sampler=GREEDY))
    stop, n = stop_string_in(model.tokenizer, undisturbed[0]["tokens"], 8)
    watch = partial(StopStringWatch, model.tokenizer, [stop, "\x00never"])
    before = settle(service)
    stopped, peer = run_held(service, _cohort(prompts, 2, [60, 60], sampler=GREEDY,
                                              per_row={0: {"stop_text": watch}}))
    assert stopped["tokens"] == undisturbed[0]["tokens"][:n] and n < 60
    assert stopped["finish_reason"] == "stop" and stopped["stats"]["engine_finish_reason"] == "stop_string"
    assert stopped["stats"]["cancelled"] is False
    assert peer["tokens"] == undisturbed[1]["tokens"]
    after = settle(service)
    assert after["requests_cancelled"] == before["requests_cancelled"]
    assert after["requests_completed"] == before["requests_completed"] + 2


def test_repetition_limits_apply_to_every_row(model, lanes, make_service, prompts):
    """repetition_limits: every row stops on a literal repetition (the shipped model repeats a
    two-token block on this prompt), its repeats trimmed; without them a row runs to its budget."""
    from mtplx.engine.repetition import RepetitionLimits

    prompt = model.tokenizer.encode("def add(a, b):\n")
    plain = greedy_ar(model, prompt, 40)
    assert plain[4:10] == plain[6:12]                 # the model does repeat
    limits = RepetitionLimits(min_tokens=10, min_repeated=6, min_repeats=3, max_block=4)
    armed = make_service(settings=EngineSettings(repetition_limits=limits, repetition_stop_all=True)).submit(
        job(prompt, max_tokens=40)).result(TIMEOUT)
    st = armed["stats"]
    assert armed["finish_reason"] == "stop" and st["repetition_stop_triggered"]
    assert armed["tokens"] == plain[:len(armed["tokens"])] and len(armed["tokens"]) < 20
    unarmed = make_service().submit(job(prompt, max_tokens=40)).result(TIMEOUT)
    assert unarmed["tokens"] == plain and not unarmed["stats"]["repetition_stop_triggered"]
