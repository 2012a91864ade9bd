"""A row's context drafts (`mtplx.engine.ngram.NgramIndex`): the longest earlier match of its
last tokens, what followed it, copied on through the drafts where the match is recent."""

import pytest

from mtplx.engine.ngram import NGRAM_MAX, NgramIndex
from mtplx.engine.proposer import ContextScore


def test_no_earlier_occurrence_no_drafts():
    assert NgramIndex([]).propose(3) == []
    assert NgramIndex([5]).propose(3) == []
    assert NgramIndex([1, 2, 3]).propose(2) == []
    assert NgramIndex([1, 2, 3]).propose(2, next_token=4) == []


def test_what_followed_the_latest_occurrence():
    idx = NgramIndex([7, 1, 2, 9, 1, 2, 8, 5, 6])
    assert idx.propose(2, next_token=1) == [2, 8]         # the latest "1" was followed by 2, 8
    idx.append(1)
    assert idx.propose(3) == [2, 8, 5]                    # the same, once the token is in the index
    assert idx.propose(3, next_token=2) == [8, 5, 6]


def test_the_longest_match_wins():
    # "1 2" last continued with 4, but "0 1 2" (longer) with 3
    idx = NgramIndex([0, 1, 2, 3, 9, 1, 2, 4, 9, 0, 1])
    assert idx.propose(1, next_token=2) == [3]
    assert NGRAM_MAX >= 3


def test_a_recent_match_copies_on_through_its_own_drafts():
    idx = NgramIndex([4, 5, 4, 5])
    assert idx.propose(5) == [4, 5, 4, 5, 4]              # period 2, longer than what follows the match
    assert NgramIndex([3, 3]).propose(4, next_token=3) == [3, 3, 3, 3]


def test_appending_equals_building_at_once():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1]
    grown = NgramIndex(tokens[:3])
    grown.extend(tokens[3:])
    whole = NgramIndex(tokens)
    assert grown.tokens == whole.tokens and grown.after == whole.after
    assert grown.propose(4, next_token=2) == whole.propose(4, next_token=2) == [3, 5, 1, 2]



def test_the_score_follows_the_source_the_target_kept():
    score = ContextScore()
    assert score.prefers_context()                      # a tie: the context
    for _ in range(3):
        score.observe(context_right=False, head_right=True)
    assert not score.prefers_context()
    for _ in range(4):
        score.observe(context_right=True, head_right=False)
    assert score.prefers_context()


@pytest.mark.parametrize("source", ["context", "scored"])
def test_greedy_rows_drafting_from_their_context_stay_exact(model, monkeypatch, source):
    """A running B8 lane chaining 2 drafts: greedy rows whose prompts repeat (their drafts come
    from their context there), rows joining mid-flight, a row that omits the bonus, a sampled row
    (the head's drafts); every greedy row's tokens equal plain greedy decoding, the head's history
    stays each row's own, and the lane never runs ahead (it reads the rows' context at launch).
    "context": context drafts used wherever there is one. "scored": as served, where the two first
    drafts differ the lane uses the source the target kept more often: on the shipped model,
    whose head copies well, the head (on Gemma 3 270M, the context: BENCHMARKS.md)."""
    from test_lane import _head_history_is_the_rows_own

    from mtplx.engine.install import install_a3b_mtp_batch_lane
    from mtplx.engine.lane import RunningLane
    from mtplx.engine.row import A3BMTPBatchRequest
    from mtplx.engine.settings import EngineSettings
    from mtplx.sampling import SamplerConfig
    from references import greedy_ar

    if source == "context":
        monkeypatch.setattr(ContextScore, "prefers_context", lambda self: True)
    lane = install_a3b_mtp_batch_lane(model, 8, selfcheck=False, depth=2)
    texts = ["    return self._items.pop()\n" * 6, "import os\nimport sys\n" * 4, "def f(x):\n    return x\n" * 5,
             "for i in range(10):\n    print(i)\n" * 3, "x = 1\ny = 2\n" * 8, "class A:\n    pass\n" * 4]
    prompts = [model.tokenizer.encode(t) for t in texts]
    budgets = [48, 40, 56, 36, 44, 30]
    hot = SamplerConfig(temperature=0.8, top_p=0.95, top_k=0)

    def run(context_drafts):
        running = RunningLane(lane, settings=EngineSettings(context_drafts=context_drafts))
        add = lambda i, **kw: running.add(A3BMTPBatchRequest(request_id=str(i), prompt_ids=prompts[i],
                                                             max_tokens=budgets[i], **kw))
        streams = [add(0), add(1, omit_speculative_bonus=True), add(2)]
        sampled = running.add(A3BMTPBatchRequest(request_id="s", prompt_ids=prompts[0], max_tokens=30,
                                                 sampler=hot, seed=3))
        for _ in range(6):
            running.step()
        streams += [add(3), add(4), add(5)]
        for _ in range(5):
            running.step()
        assert _head_history_is_the_rows_own(model, running)
        rows = [r for r in running.rows if r is not None]
        while running.has_work:
            running.step()
        return running, streams, sampled, rows

    with_context, streams, sampled, rows = run(True)
    head_only, _, sampled_alone, _ = run(False)
    for i, s in enumerate(streams):
        assert s.tokens == greedy_ar(model, prompts[i], budgets[i]), f"row {i}"
    assert sampled.tokens == sampled_alone.tokens           # a sampled row's draws are its own either way
    got, base = with_context.stats(), head_only.stats()
    assert got.ahead_cycles == 0 and base.ahead_cycles > 0 and base.context_drafts == 0
    scored = [r.context_score for r in rows if r.context is not None]
    assert len(scored) == 6 and all(r.context is None for r in rows if not r.greedy)   # the sampled row: the head's
    if source == "context":
        assert got.context_drafts > 100
    else:
        assert sum(not s.prefers_context() for s in scored) >= 5 and got.context_drafts < 50
