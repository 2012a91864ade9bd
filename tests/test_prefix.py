"""Prefix reuse through the session bank: cached tokens reported, greedy output unchanged."""

from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.decode import generate_mtpk
from mtplx.engine.prefix_cache import PrefixState
from mtplx.sampling import SamplerConfig
from mtplx.scheduler.session_bank import SessionBank

GREEDY = SamplerConfig(temperature=0.0)
SYSTEM = "You are a careful Python programmer. " * 40


def _chat(model, turns):
    return model.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)


def _ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


def test_second_turn_reuses_prefix_with_identical_output(model):
    bank = SessionBank("test")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a parser."}]
    p1 = _ids(_chat(model, turn1))
    r1 = generate_mtpk(model, p1, 24, GREEDY, session_restore=lambda: bank.lookup(p1), session_commit=bank.commit)
    # banked: the last chunk boundary's state and the whole prompt's
    assert r1.stats["cached_tokens"] == 0 and bank.stats()["entries"] == 2
    answer = model.tokenizer.decode(r1.tokens)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now test it."}]
    p2 = _ids(_chat(model, turn2))
    warm = generate_mtpk(model, p2, 48, GREEDY, session_restore=lambda: bank.lookup(p2), session_commit=bank.commit)
    cold = generate_mtpk(model, p2, 48, GREEDY)
    assert warm.stats["cached_tokens"] >= 256 and warm.stats["cached_tokens"] % 256 == 0
    assert warm.tokens == cold.tokens


def test_cohort_rows_reuse_prefix(model):
    lane = install_a3b_mtp_batch_lane(model, 3)
    bank = SessionBank("test")
    base = _ids(_chat(model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]))
    prompts = [base + model.tokenizer.encode(f"# part {i}\n") for i in range(3)]

    def reqs(use_bank):
        out = []
        for i, p in enumerate(prompts):
            restore, commit = bank.hooks(p) if use_bank else (None, None)
            out.append(A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=GREEDY, max_tokens=24,
                                          session_restore=restore, session_commit=commit))
        return out

    first = generate_a3b_mtp_batch(lane, reqs(True))
    # rows prefill one after another, so rows 1 and 2 already reuse row 0's shared prefix
    assert first.streams[0].cached_tokens == 0
    assert all(s.cached_tokens >= 256 for s in first.streams[1:])
    second = generate_a3b_mtp_batch(lane, reqs(True))
    cold = generate_a3b_mtp_batch(lane, reqs(False))
    assert all(s.cached_tokens >= 256 for s in second.streams)
    assert [s.cached_tokens for s in cold.streams] == [0, 0, 0]
    assert [s.tokens for s in first.streams] == [s.tokens for s in cold.streams]
    assert [s.tokens for s in second.streams] == [s.tokens for s in cold.streams]


def test_repeated_prompt_needs_no_prefill_and_decodes_the_same(model):
    """A prompt seen before restores its whole prefill (cached_tokens = the prompt) and decodes as
    a cold run does, greedy and seeded sampled rows alike; a longer prompt that starts with it
    does not take that state (it would continue off the chunk partition)."""
    lane = install_a3b_mtp_batch_lane(model, 3)
    bank = SessionBank("test")
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):\n", "class Queue:\n    def __init__(self):\n", "import os\n")]
    sampled = SamplerConfig(temperature=0.8, top_p=0.95)

    def run(use_bank, sampler, ps=prompts):
        reqs = []
        for i, p in enumerate(ps):
            restore, commit = bank.hooks(p) if use_bank else (None, None)
            reqs.append(A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=sampler, max_tokens=24, seed=7 + i,
                                           session_restore=restore, session_commit=commit))
        return generate_a3b_mtp_batch(lane, reqs).streams

    for sampler in (GREEDY, sampled):
        cold = run(False, sampler)
        first = run(True, sampler)
        again = run(True, sampler)
        assert [s.cached_tokens for s in again] == [len(p) for p in prompts]
        assert [s.tokens for s in first] == [s.tokens for s in cold]
        assert [s.tokens for s in again] == [s.tokens for s in cold]
    longer = [p + tok.encode("    return a + b\n") for p in prompts[:2]]
    warm = run(True, GREEDY, longer)
    assert [s.cached_tokens for s in warm] == [0, 0]
    assert [s.tokens for s in warm] == [s.tokens for s in run(False, GREEDY, longer)]
    solo = generate_mtpk(model, prompts[1], 24, GREEDY, session_restore=lambda: bank.lookup(prompts[1]),
                         session_commit=bank.commit)
    assert solo.stats["cached_tokens"] == len(prompts[1])
    assert solo.tokens == generate_mtpk(model, prompts[1], 24, GREEDY).tokens


def test_broken_bank_never_breaks_decoding(model):
    def boom(*_a):
        raise RuntimeError("bank down")

    p = list(range(5, 400))
    r = generate_mtpk(model, p, 8, GREEDY, session_restore=boom, session_commit=boom)
    assert len(r.tokens) == 8 and r.stats["cached_tokens"] == 0


def test_bank_lru_budget_and_longest_match(model):
    import mlx.core as mx

    def state(key, n_bytes):
        arr = mx.zeros((n_bytes // 4,), dtype=mx.float32)
        return PrefixState(tuple(key), ((arr, arr[:0]),), ())

    bank = SessionBank("fp", max_bytes=1000)
    bank.commit(state([1, 2], 400))
    bank.commit(state([1, 2, 3, 4], 400))
    assert bank.lookup([1, 2, 3, 4, 5]).key == (1, 2, 3, 4)
    assert bank.lookup([1, 2, 9]).key == (1, 2)
    assert bank.lookup([7]) is None
    bank.commit(state([5, 6], 400))      # over budget: evicts the least recently used
    assert bank.stats()["evictions"] == 1 and bank.lookup([1, 2, 3, 4, 0]).key == (1, 2)
    # a whole prompt's state serves that exact prompt only, before any boundary prefix of it
    whole = PrefixState((1, 2, 7), ((mx.zeros((10,)), mx.zeros((0,))),), (), out=(mx.zeros((4,)), mx.zeros((1, 1, 2))))
    bank.commit(whole)
    assert bank.lookup([1, 2, 7]) is whole and whole.cached_tokens == 3
    assert bank.lookup([1, 2, 7, 8]).key == (1, 2)


def test_bank_fits_in_the_room_rows_leave_it(model):
    import mlx.core as mx

    def state(key, n_bytes):
        arr = mx.zeros((n_bytes // 4,), dtype=mx.float32)
        return PrefixState(tuple(key), ((arr, arr[:0]),), ())

    room = [1000]
    bank = SessionBank("fp", max_bytes=1000)
    bank.room = lambda: room[0]
    bank.commit(state([1, 2], 400))
    bank.commit(state([3, 4], 400))
    room[0] = 600                        # rows took memory: a commit keeps the bank within what is left
    bank.commit(state([5, 6], 400))
    assert bank.stats()["bytes"] == 400 and bank.lookup([5, 6, 7]).key == (5, 6)
    room[0] = 300
    bank.commit(state([7, 8], 400))      # larger than the room: not kept, nothing evicted for it
    assert bank.stats()["entries"] == 1 and bank.lookup([7, 8, 9]) is None
    bank.shrink(0)                       # rows about to join need every byte
    stats = bank.stats()
    assert stats["bytes"] == 0 and stats["yielded_to_rows"] == 1 and stats["evictions"] == 3


def test_service_reuses_prefixes_for_jobs_without_hooks(model):
    """for_model gives the service a bank: a second job sharing a long prefix reports cached
    tokens and the same greedy output as a cold run."""
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    service = MTPBatchGenerationService.for_model(model, widths=(3,))
    try:
        base = _ids(_chat(model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]))

        def job(i, prompt):
            return MTPBatchJob(request_id=f"r{i}", prompt_ids=prompt, max_tokens=16, sampler=GREEDY,
                               draft_sampler=GREEDY, seed=0, stop_token_ids=set(), token_callback=None,
                               compatibility_key=("k",), generation_limits={}, solo_runner=None,
                               cancel_error=lambda j: RuntimeError("cancelled"))

        first = service.submit(job(0, base)).result(timeout=120)
        second = service.submit(job(1, base + [7, 8])).result(timeout=120)
        cold = generate_mtpk(model, base + [7, 8], 16, GREEDY)
        assert first["stats"]["cached_tokens"] == 0 and second["stats"]["cached_tokens"] >= 256
        assert second["tokens"] == cold.tokens
        assert service.snapshot()["session_bank"]["hits"] >= 1
    finally:
        service.shutdown(timeout_s=10)
