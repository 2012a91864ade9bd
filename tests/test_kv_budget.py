"""Admission by memory: rows join lanes only while every lane's decode state fits the budget."""

import pytest

from mtplx.a3b_mtp_batch import install_a3b_mtp_batch_lane
from mtplx.generation import CapacityError, KVBudgetError
from mtplx.models.cache import STEP
from mtplx.sampling import SamplerConfig
from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob, row_state_bytes

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
