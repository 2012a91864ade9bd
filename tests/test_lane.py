"""The fixed-width batched MTP lane: exact greedy rows, row isolation, validation, self-check."""

import threading

import numpy as np
import pytest

import mtplx.a3b_mtp_batch as lane_mod
from mtplx.a3b_mtp_batch import (A3BMTPBatchCapacityError, A3BMTPBatchRequest, LaneSelfCheckError,
                                 generate_a3b_mtp_batch, install_a3b_mtp_batch_lane)
from mtplx.generation import generate_ar
from mtplx.sampling import SamplerConfig

GREEDY = SamplerConfig(temperature=0.0)
TEXTS = [
    "def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
    "for i in range(10):\n", "try:\n    import json", "x", "@property\ndef name(self):",
    "if __name__ == '__main__':\n",
]


@pytest.fixture(scope="module")
def lanes(model):
    return {w: install_a3b_mtp_batch_lane(model, w) for w in (3, 8)}


def _req(i, ids, n, sampler=GREEDY, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=ids, sampler=sampler, max_tokens=n, **kw)


def _prompts(model, k):
    return [model.tokenizer.encode(t) for t in TEXTS[:k]]


def test_install_receipt_and_route(lanes, model):
    lane = lanes[8]
    assert lane.width == 8 and lane.depth == 1 and lane.verify_t == 2
    assert lane.selfcheck["ok"] and set(lane.selfcheck["commit_keeps_seen"]) >= {0, 2}
    assert "b8" in lane.route_id and model.model_id in lane.route_id
    assert lane.config_fingerprint.endswith(lane.route_id)


@pytest.mark.parametrize("width,real", [(8, 8), (8, 5), (3, 3), (3, 2), (8, 2)])
def test_every_greedy_row_equals_solo_ar(model, lanes, width, real):
    prompts = _prompts(model, real)
    if real >= 5:
        prompts[1] = prompts[1] * 60          # several hundred tokens beside 1-token prompts
    budgets = [64 + 16 * (i % 3) for i in range(real)]
    res = generate_a3b_mtp_batch(lanes[width], [_req(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))])
    assert res.real_width == real and res.fixed_width == width and res.width_histogram == {width: res.cycles}
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert res.streams[i].tokens == generate_ar(model, p, n, GREEDY).tokens, f"row {i}"
        assert res.streams[i].finish_reason == "length"
    assert res.accepted_drafts > 0


def test_stops_at_different_cycles_and_first_token_finish(model, lanes):
    prompts = _prompts(model, 6)
    solo = [generate_ar(model, p, 48, GREEDY).tokens for p in prompts]
    stops = [{s[k]} for s, k in zip(solo, (0, 3, 9, 20, 30, 47))]
    reqs = [_req(i, p, 48, stop_token_ids=st) for i, (p, st) in enumerate(zip(prompts, stops))]
    reqs[5] = _req(5, prompts[5], 1)
    res = generate_a3b_mtp_batch(lanes[8], reqs)
    for i, (s, st) in enumerate(zip(solo, stops)):
        stream = res.streams[i]
        if i == 5:
            assert stream.tokens == s[:1] and stream.finish_reason == "length"
            continue
        cut = s.index(next(iter(st))) + 1
        assert stream.tokens == s[:cut] and stream.finish_reason == "stop"
    assert res.streams[0].cycles == 1


def _row_view(s):
    return (s.tokens, s.finish_reason, s.accepted_drafts, s.rejected_drafts, s.cycles)


def test_cancel_mid_decode_and_before_prefill_leave_others_identical(model, lanes):
    prompts = _prompts(model, 6)
    base = generate_a3b_mtp_batch(lanes[8], [_req(i, p, 64) for i, p in enumerate(prompts)])
    seen = []
    reqs = [_req(i, p, 64) for i, p in enumerate(prompts)]
    reqs[1] = _req(1, prompts[1], 64, on_token=seen.append, cancelled=lambda: len(seen) >= 10)
    reqs[4] = _req(4, prompts[4], 64, cancelled=lambda: True)
    res = generate_a3b_mtp_batch(lanes[8], reqs)
    assert res.streams[1].finish_reason == "cancelled" and 10 <= len(res.streams[1].tokens) < 64
    assert res.streams[1].tokens == base.streams[1].tokens[:len(res.streams[1].tokens)]
    assert res.streams[4].finish_reason == "cancelled" and res.streams[4].tokens == []
    for i in (0, 2, 3, 5):
        assert _row_view(res.streams[i]) == _row_view(base.streams[i]), f"row {i} was disturbed"


def test_callbacks_fire_once_per_row(model, lanes):
    prompts = _prompts(model, 3)
    events = []
    lock = threading.Lock()

    def rec(*e):
        with lock:
            events.append(e)

    reqs = [_req(i, p, 20, on_decode_start=lambda i=i: rec("start", i),
                 on_terminal=lambda reason, cycles, i=i: rec("end", i, reason)) for i, p in enumerate(prompts)]
    res = generate_a3b_mtp_batch(lanes[3], reqs)
    assert sorted(e for e in events if e[0] == "start") == [("start", i) for i in range(3)]
    assert sorted(e for e in events if e[0] == "end") == [("end", i, "length") for i in range(3)]
    assert all(s.terminal_perf_s is not None for s in res.streams)


def test_sampled_cohort_reproducible_and_row_independent(model, lanes):
    cfg = SamplerConfig(temperature=0.7)
    prompts = _prompts(model, 8)
    reqs = [_req(i, p, 40, cfg, seed=100 + i) for i, p in enumerate(prompts)]
    a = generate_a3b_mtp_batch(lanes[8], reqs)
    b = generate_a3b_mtp_batch(lanes[8], reqs)
    assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]
    # Change every neighbour of row 0 (prompts, seeds, budgets): row 0's output must not move.
    others = [_req(i, prompts[(i + 3) % 8], 17 + i, cfg, seed=900 + i) for i in range(1, 8)]
    c = generate_a3b_mtp_batch(lanes[8], [reqs[0]] + others)
    assert c.streams[0].tokens == a.streams[0].tokens
    assert a.accepted_drafts + a.rejected_drafts > 0


def test_validation_and_capacity_errors(model, lanes):
    lane = lanes[3]
    p = [1, 2, 3]
    with pytest.raises(ValueError, match="2..3"):
        generate_a3b_mtp_batch(lane, [_req(0, p, 4)])
    with pytest.raises(ValueError, match="2..3"):
        generate_a3b_mtp_batch(lane, [_req(i, p, 4) for i in range(4)])
    with pytest.raises(ValueError, match="empty"):
        generate_a3b_mtp_batch(lane, [_req(0, p, 4), _req(1, [], 4)])
    with pytest.raises(ValueError, match="max_tokens"):
        generate_a3b_mtp_batch(lane, [_req(0, p, 4), _req(1, p, 0)])
    with pytest.raises(A3BMTPBatchCapacityError, match="context window"):
        generate_a3b_mtp_batch(lane, [_req(0, p, 4), _req(1, p, model.max_context)])
    with pytest.raises(ValueError, match="width"):
        install_a3b_mtp_batch_lane(model, 1)
    with pytest.raises(ValueError, match="numerics"):
        install_a3b_mtp_batch_lane(model, 4, numerics="fast")


def test_selfcheck_refuses_a_miswired_lane(model, monkeypatch):
    real = lane_mod.commit_rows

    def keeps_everything(caches, written, keep):  # forgets to drop rejected draft slots
        return real(caches, written, np.where(np.asarray(keep) > 0, written, 0))

    monkeypatch.setattr(lane_mod, "commit_rows", keeps_everything)
    with pytest.raises(LaneSelfCheckError, match="refused"):
        install_a3b_mtp_batch_lane(model, 4)


def test_any_width_installs(model):
    for w in (2, 5, 16):
        assert install_a3b_mtp_batch_lane(model, w).selfcheck["ok"]


def test_compiled_and_eager_lanes_agree(model):
    """The compiled cycle graphs are an optimisation only: same tokens, greedy and sampled."""
    prompts = _prompts(model, 4)
    lanes = [install_a3b_mtp_batch_lane(model, 4, compiled=c) for c in (True, False)]
    for cfg in (GREEDY, SamplerConfig(temperature=0.7)):
        reqs = [_req(i, p, 40, cfg, seed=i) for i, p in enumerate(prompts)]
        a, b = (generate_a3b_mtp_batch(lane, reqs) for lane in lanes)
        assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]
