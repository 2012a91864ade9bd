"""Rows admitted at one cycle boundary whose prefill is one chunk prefill together, in one
forward: each row's state and tokens are its own prefill's."""

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.admission import RowPrefill, batchable
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.settings import EngineSettings
from mtplx.engine.row import A3BMTPBatchRequest, LaneRow
from mtplx.sampling import SamplerConfig

from references import greedy_ar

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "x", "class Stack:\n    def __init__(self):",
         "for i in range(10):\n", "try:\n    import json"]


@pytest.fixture(scope="module")
def lane8(model):
    return install_a3b_mtp_batch_lane(model, 8, selfcheck=False)


def _req(i, ids, n, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=ids, max_tokens=n, **kw)


def _alone(model, ids, **kw):
    """Row `ids`' own prefill: (logits, hidden, target KV of layer 0, head history of its layer 0)."""
    adm = RowPrefill(model, LaneRow(_req("alone", ids, 1, **kw), model.vocab_size), 256)
    while adm.out is None:
        adm.advance()
    return adm


def test_rows_admitted_together_prefill_in_one_forward_each_as_its_own(model, lane8):
    """Six rows of prompts 1-14 tokens long join an empty lane at once: one forward prefills them
    all; each row's last logits and hidden, its target KV and its head history equal its own
    prefill's, and each row decodes to plain greedy."""
    assert batchable(model)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) > 3 and min(len(p) for p in prompts) == 1
    running = RunningLane(lane8, prefill_budget=None)
    streams = [running.add(_req(i, p, 24)) for i, p in enumerate(prompts)]
    running.admit()
    assert running.counters.batched_prefills == 1 and running.live_rows == 6
    for b, p in enumerate(prompts):
        own = _alone(model, p)
        logits, hidden = own.out
        assert np.allclose(np.array(running.state.logits_last[b]), np.array(logits), atol=1e-4)
        assert np.allclose(np.array(running.state.h_last[b]), np.array(hidden[0]), atol=1e-4)
        for lane_layer, own_layer in ((running.state.caches[0], own.cache[0]), (running.state.mtp_caches[0], own.mtp_cache[0])):
            n = int(own_layer.offset)
            assert int(lane_layer.lengths[b]) == n
            if n:
                assert mx.allclose(lane_layer.keys[b, :, :n], own_layer.keys[0, :, :n], atol=1e-4).item()
    while running.has_work:
        running.step()
    for s, p in zip(streams, prompts):
        assert s.tokens == greedy_ar(model, p, 24)


def test_a_long_prompt_and_a_banked_prefix_in_the_line(model, lane8):
    """Rows in line: two short ones (prefilled together), a 300-token prompt (its own chunks, one a
    step), then a row whose first 256 tokens are banked (its last chunk, prefilled together with
    the short row behind it). Within a budget of 256 prompt tokens a step. Every row equals plain
    greedy; sampled rows among them too equal themselves decoded alone."""
    from mtplx.engine.installed import solo_lane

    base = model.tokenizer.encode("import os\n" * 120)[:300]
    assert len(base) == 300
    banked = {}
    adm = RowPrefill(model, LaneRow(_req("bank", base, 1, session_commit=lambda s: banked.setdefault(len(s.key), s)),
                                   model.vocab_size), 256)
    while adm.out is None:
        adm.advance()
    state = banked[257]                                     # the boundary state at 256 tokens
    restored = base[:257] + model.tokenizer.encode("def main():\n    return 0\n")
    short = [model.tokenizer.encode(t) for t in TEXTS[:3]]
    hot = SamplerConfig(temperature=0.8, top_p=0.95, top_k=0)
    reqs = [_req(0, short[0], 20), _req(1, short[1], 20, sampler=hot, seed=4), _req(2, base, 20),
            _req(3, restored, 20, session_restore=lambda: state), _req(4, short[2], 20, sampler=hot, seed=9)]
    running = RunningLane(lane8)
    streams = [running.add(r) for r in reqs]
    while running.has_work:
        running.step()
    assert running.counters.batched_prefills == 2 and streams[3].cached_tokens == 256
    for i in (0, 2, 3):
        assert streams[i].tokens == greedy_ar(model, list(reqs[i].prompt_ids), 20), f"row {i}"
    for i in (1, 4):
        alone = RunningLane(solo_lane(model))
        ref = alone.add(reqs[i])
        while alone.has_work:
            alone.step()
        assert streams[i].tokens == ref.tokens, f"row {i}"


def test_one_token_prompts_admitted_together(model, lane8):
    """Rows whose prompts are one token each, admitted at one boundary, prefill together (their
    head has no history entry yet) and each decodes to plain greedy."""
    prompts = [model.tokenizer.encode(t) for t in ("x", "(", "x")]
    assert all(len(p) == 1 for p in prompts)
    running = RunningLane(lane8)
    streams = [running.add(_req(i, p, 24)) for i, p in enumerate(prompts)]
    while running.has_work:
        running.step()
    assert running.counters.batched_prefills == 1
    for p, s in zip(prompts, streams):
        assert s.tokens == greedy_ar(model, p, 24)


def _lengths_settled(running) -> bool:
    """Every ragged layer's host lengths equal its device offsets (the lane's caches and head's)."""
    layers = (running.state.caches or []) + (running.state.mtp_caches or [])
    return all(np.array_equal(c.lengths, np.array(c.offset)) for c in layers if c.keys is not None)


def test_a_lane_running_ahead_decodes_greedy_rows_as_without(model):
    """With `run_ahead`, a lane of greedy rows launches each MTP cycle from the last one's verify
    before the host reads it (the keep, the next primaries and the commit on the device). Rows
    that stop at a stop token, on `max_tokens`, on a repetition, that omit the bonus, that do not
    draft, that are cancelled or join mid-flight come out token for token as without running
    ahead and as plain greedy, at depth 3 and depth 1; between steps the host's lengths equal
    the device's offsets; while a sampled row is live the lane does not run ahead."""
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    hot = SamplerConfig(temperature=0.7, top_p=0.9, top_k=0)
    solo = [greedy_ar(model, p, 60) for p in prompts]

    def run(depth, run_ahead):
        running = RunningLane(install_a3b_mtp_batch_lane(model, 8, selfcheck=False, depth=depth),
                              settings=EngineSettings(run_ahead=run_ahead, context_drafts=False))
        reqs = [_req(0, prompts[0], 60, stop_token_ids=frozenset({solo[0][23]})),
                _req(1, prompts[1], 37, omit_speculative_bonus=True),
                _req(2, prompts[0], 60, speculative=False),
                _req(3, prompts[3], 60, repetition_stop=True),
                _req(4, prompts[4], 1),
                _req(5, prompts[5], 60)]
        streams = [running.add(r) for r in reqs]
        sampled_steps = []
        for n in range(60):
            if n == 5:
                running.remove(["5"])
                streams.append(running.add(_req(6, prompts[0], 45)))
            if n == 12:
                streams.append(running.add(_req(7, prompts[1], 6, sampler=hot, seed=7)))
            before = running.counters.ahead_cycles
            running.step()
            assert _lengths_settled(running), f"step {n}"
            if not streams[-1].finish_reason and len(streams) == 8 and n > 12:
                sampled_steps.append(running.counters.ahead_cycles - before)
            if not running.has_work:
                break
        assert not running.has_work
        return running, streams, sampled_steps

    for depth in (3, 1):
        serial, expected, _ = run(depth, False)
        ahead, got, sampled_steps = run(depth, True)
        assert serial.counters.ahead_cycles == 0 and ahead.counters.ahead_cycles > 15, depth
        assert sampled_steps and not any(sampled_steps[1:]), "a lane holding a sampled row ran ahead"
        # the cancelled row leaves at the boundary after the cycle launched ahead: its tokens go on to there
        assert got[5].finish_reason == expected[5].finish_reason == "cancelled"
        assert got[5].tokens[:len(expected[5].tokens)] == expected[5].tokens == solo[5][:len(expected[5].tokens)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if i != 5:
                assert (g.tokens, g.finish_reason) == (e.tokens, e.finish_reason), f"depth {depth} row {i}"
        for i in (0, 1, 2, 4, 6):
            ref = solo[{2: 0, 6: 0}.get(i, i)]
            assert got[i].tokens == ref[:len(got[i].tokens)], f"depth {depth} row {i}"
        assert got[0].finish_reason == "stop" and got[0].tokens == solo[0][:solo[0].index(solo[0][23]) + 1]
        assert got[1].tokens == solo[1][:37] and got[4].tokens == solo[4][:1] and got[2].tokens == solo[0]


def test_overlapped_cycles_decode_every_row_as_without(model, lane8):
    """With `overlap`, a step whose next boundary has nothing to do launches the next MTP cycle
    before returning; rows joining, cancelled and finishing meanwhile wait for it. Greedy,
    sampled (chaining 2 drafts), logprob and cancelled rows come out token for token as from the
    same lane without overlap, and their tokens arrive in the same steps' events, one step later
    for the rows the launched cycle delayed at most."""
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    hot = SamplerConfig(temperature=0.7, top_p=0.9, top_k=0)

    def run(overlap):
        running = RunningLane(install_a3b_mtp_batch_lane(model, 8, selfcheck=False, depth=2),
                              settings=EngineSettings(overlap=overlap))
        streams = [running.add(_req(i, prompts[i], 40 + 7 * i, sampler=hot if i % 2 else SamplerConfig(),
                                    seed=i, logprobs=2 if i == 3 else None)) for i in range(4)]
        for _ in range(6):
            running.step()
        streams += [running.add(_req(i, prompts[i], 30, sampler=hot, seed=i)) for i in (4, 5)]
        running.remove(["1"])
        while running.has_work:
            running.step()
        return running, streams

    serial, expected = run(False)
    overlapped, got = run(True)
    assert serial.counters.overlapped_cycles == 0 and overlapped.counters.overlapped_cycles > 20
    assert got[1].finish_reason == expected[1].finish_reason == "cancelled"
    for i, (g, e) in enumerate(zip(got, expected)):
        if i != 1:
            assert g.tokens == e.tokens and g.finish_reason == e.finish_reason, f"row {i}"
    assert [lp for lp, _ in got[3].logprobs] == pytest.approx([lp for lp, _ in expected[3].logprobs], abs=1e-5)
