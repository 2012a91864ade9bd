"""Admission by memory: rows join lanes only while every lane's decode state fits the budget."""

import pytest

from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.prefill import CapacityError, KVBudgetError
from mtplx.models.cache import STEP
from mtplx.sampling import SamplerConfig
from mtplx.scheduler.budget import row_state_bytes
from mtplx.scheduler.session_bank import SessionBank
from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

from references import greedy_ar

GREEDY = SamplerConfig(temperature=0.0)
TEXTS = ["def add(a, b):\n", "import os\n", "class Node:\n", "for i in range(3):\n", "x = [1, 2, 3]\n"]


def test_row_state_bytes_counts_every_kv_layer(model):
    per_position, per_row = row_state_bytes(model)
    args = model.target.args
    layers = args.num_hidden_layers + 1                    # the target's and the MTP head's
    assert per_position == layers * 2 * args.num_key_value_heads * args.head_dim * 4    # K and V, fp32
    assert per_row == 0                                    # attention only: nothing fixed per row


def test_rows_wait_for_memory_and_a_row_that_never_fits_fails_alone(model):
    per_position, _ = row_state_bytes(model)
    lanes = {w: install_a3b_mtp_batch_lane(model, w) for w in (3, 8)}
    # Three rows of one 256-position buffer fit (a B3 lane); a fourth would need the B8 lane.
    budget = 3 * STEP * per_position
    service = MTPBatchGenerationService(model, lanes, batch_wait_s=0.0, kv_budget_bytes=budget)
    try:
        prompts = [model.tokenizer.encode(t) for t in TEXTS]
        jobs = [MTPBatchJob(f"r{i}", p, 40, GREEDY, seed=i, compatibility_key="k") for i, p in enumerate(prompts)]
        too_big = MTPBatchJob("big", prompts[0], 1000, GREEDY, compatibility_key="k")
        futures = service.submit_cohort(jobs + [too_big])
        with pytest.raises(KVBudgetError, match="lower max_tokens") as err:
            futures[-1].result(timeout=60)
        assert isinstance(err.value, CapacityError)             # the HTTP layer answers 400
        for p, f in zip(prompts, futures):
            result = f.result(timeout=120)
            assert result["tokens"] == greedy_ar(model, p, 40)
            assert result["stats"]["mtp_batch_fixed_width"] <= 3     # never widened past the budget
    finally:
        service.shutdown(timeout_s=30)


def test_the_prefix_bank_holds_only_what_rows_leave_and_yields_it_to_them(model):
    per_position, _ = row_state_bytes(model)
    lanes = {w: install_a3b_mtp_batch_lane(model, w) for w in (3, 8)}
    budget = 3 * STEP * per_position             # one B3 lane of one-buffer rows takes all of it
    bank = SessionBank("fp")
    service = MTPBatchGenerationService(model, lanes, batch_wait_s=0.0, kv_budget_bytes=budget, session_bank=bank)
    held = []                                     # at every commit: the bank's bytes + the lanes' state
    commit = bank.commit

    def watched_commit(state):
        commit(state)
        held.append(bank.stats()["bytes"] + service._held_bytes())

    bank.commit = watched_commit
    try:
        prompts = [model.tokenizer.encode(t) for t in TEXTS]
        alone = MTPBatchJob("alone", prompts[0], 16, GREEDY, compatibility_key="k")
        assert service.submit_cohort([alone])[0].result(timeout=60)["tokens"] == greedy_ar(model, prompts[0], 16)
        assert bank.stats()["entries"] == 1 and bank.stats()["yielded_to_rows"] == 0   # its prompt, banked

        jobs = [MTPBatchJob(f"r{i}", p, 40, GREEDY, compatibility_key="k") for i, p in enumerate(prompts[1:4])]
        for p, f in zip(prompts[1:4], service.submit_cohort(jobs)):
            assert f.result(timeout=120)["tokens"] == greedy_ar(model, p, 40)
        stats = bank.stats()
        assert stats["yielded_to_rows"] == 1 and stats["bytes"] == 0    # the B3 lane needed every byte
        assert held and max(held) <= budget
    finally:
        service.shutdown(timeout_s=30)


def test_b1_exact_rows_and_solo_runner_jobs_take_from_the_same_budget(model):
    """Every job enters through one admission: b1-exact rows (one-row lanes) and a job with its
    own solo runner fail alone when they can never fit, and the runner is never called."""
    per_position, _ = row_state_bytes(model)
    budget = STEP * per_position                  # one row of one 256-position buffer
    prompt = model.tokenizer.encode(TEXTS[0])
    called = []

    def runner(job):
        called.append(job.request_id)
        return {"tokens": [1], "finish_reason": "length", "stats": {}}

    for numerics in ("b1-exact", "throughput"):
        lanes = {} if numerics == "b1-exact" else {3: install_a3b_mtp_batch_lane(model, 3)}
        service = MTPBatchGenerationService(model, lanes, numerics=numerics, batch_wait_s=0.0,
                                            kv_budget_bytes=budget)
        try:
            fits = MTPBatchJob("fits", prompt, 16, GREEDY, compatibility_key="k")
            big = MTPBatchJob("big", prompt, 1000, GREEDY, compatibility_key="k")
            big_runner = MTPBatchJob("big-runner", prompt, 1000, GREEDY, compatibility_key="r", solo_runner=runner)
            futures = service.submit_cohort([fits, big, big_runner])
            assert futures[0].result(timeout=60)["tokens"] == greedy_ar(model, prompt, 16)
            for f in futures[1:]:
                with pytest.raises(KVBudgetError, match="lower max_tokens"):
                    f.result(timeout=60)
        finally:
            service.shutdown(timeout_s=30)
    assert called == []


def test_a_solo_runner_job_waits_for_memory_then_runs_at_its_turn(model):
    """A runner job that fits only once a lane's rows have ended waits first in the queue, then
    its runner is called (alone: the lane is gone)."""
    per_position, _ = row_state_bytes(model)
    lanes = {3: install_a3b_mtp_batch_lane(model, 3)}
    budget = 3 * STEP * per_position                 # one B3 lane of one-buffer rows takes all of it
    service = MTPBatchGenerationService(model, lanes, batch_wait_s=0.0, kv_budget_bytes=budget)
    lane_busy = []

    def runner(job):
        lane_busy.append(bool(service._running))
        return {"tokens": [7, 8], "finish_reason": "length", "stats": {"verify_calls": 2}}

    try:
        prompts = [model.tokenizer.encode(t) for t in TEXTS[:3]]
        rows = [MTPBatchJob(f"r{i}", p, 40, GREEDY, compatibility_key="k") for i, p in enumerate(prompts)]
        futures = service.submit_cohort(rows)
        alone = MTPBatchJob("runner", prompts[0], 16, GREEDY, compatibility_key="other", solo_runner=runner)
        result = service.submit(alone).result(timeout=120)
        assert result["tokens"] == [7, 8] and result["stats"]["scheduler_policy"] == "solo_mtp"
        assert lane_busy == [False]                      # it waited until the lane's rows freed the budget
        assert all(f.done() for f in futures) and alone.admitted_s >= max(r.completed_s for r in rows)
    finally:
        service.shutdown(timeout_s=30)
