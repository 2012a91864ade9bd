"""Structured output inside the running lane: a constrained row's greedy MTP output equals its
greedy AR output and an independent oracle (mlx-lm's `generate_step` with a logits processor
applying the same grammar's masks from a matcher of its own), beside unconstrained neighbours;
completed outputs validate; sampled constrained rows keep the restricted target distribution
(chi-square with a power check); the thinking gate and budget; `min_tokens` (stop tokens held
back); bad constraints refused."""

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.settings import EngineSettings
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.sampling import SamplerConfig, row_distribution
from mtplx.structured import (Constraint, ConstraintError, check_constraint, choice_grammar, grammar_tokenizer,
                              holding_back, json_schema_grammar, regex_grammar)

GREEDY = SamplerConfig(temperature=0.0)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                                      "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["ok", "score", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
]
TEXTS = ["def fibonacci(n):", "import os\n", "x = {", "class A:\n", "for i in", "return"]


@pytest.fixture(scope="module")
def deep_lane(model):
    return install_a3b_mtp_batch_lane(model, 8, depth=3)


@pytest.fixture(scope="module")
def llg_tokenizer(model):
    return grammar_tokenizer(model.tokenizer, model.vocab_size)


def _req(i, ids, n, constraint=None, sampler=GREEDY, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=tuple(ids), sampler=sampler, max_tokens=n,
                              constraint=constraint, **kw)


def _run(lane, reqs, stagger=0, **kw):
    """Rows through a running lane; with `stagger`, row i joins after i * stagger steps."""
    running = RunningLane(lane, **kw)
    streams, pending = {}, list(reqs)
    step = 0
    while pending or running.has_work:
        while pending and (not stagger or step >= stagger * len(streams)):
            req = pending.pop(0)
            streams[req.request_id] = running.add(req)
        running.step()
        step += 1
    return [streams[r.request_id] for r in reqs], running


def _oracle(model, llg_tokenizer, ids, grammar, n):
    """mlx-lm's greedy `generate_step` with a logits processor that masks to what an llguidance
    matcher of its own allows after the tokens so far; up to (not including) the end of sequence."""
    import llguidance
    import llguidance.numpy
    from mlx_lm.generate import generate_step

    # generate_step asks for the next position's logits before it yields a token: the processor
    # consumes what it has not seen; `ender` follows the yielded tokens to see the grammar end
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    ender = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    bits = llguidance.numpy.allocate_token_bitmask(1, llg_tokenizer.vocab_size)
    seen = [len(ids)]

    def processor(tokens, logits):
        for t in np.array(tokens)[seen[0]:].tolist():
            assert matcher.consume_token(int(t))
        seen[0] = tokens.size
        llguidance.numpy.fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:model.vocab_size].astype(bool)
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    out = []
    for token, _ in generate_step(mx.array(list(ids)), model.target, max_tokens=n, logits_processors=[processor]):
        if int(token) in model.eos_token_ids:
            break
        out.append(int(token))
        assert ender.consume_token(int(token))
        if ender.is_stopped():
            break
    return out


def test_greedy_constrained_mtp_equals_ar_and_the_oracle(model, deep_lane, llg_tokenizer):
    """Constrained greedy rows (three schemas, a regex, one after a thinking budget) in a
    depth-3 lane beside unconstrained greedy and sampled rows joining at different steps: each
    equals its greedy AR decoding under the same grammar, and mlx-lm with the grammar's masks;
    every row's tokens are the same with overlapped cycles;
    every completed JSON output validates and ends with "stop"."""
    tok = model.tokenizer
    eos = frozenset(model.eos_token_ids)
    constraints = [Constraint(json_schema_grammar(s), "json_schema") for s in SCHEMAS]
    constraints.append(Constraint(regex_grammar(r"(yes|no) because [a-z ]{1,20}\."), "regex"))
    constraints.append(Constraint(json_schema_grammar(SCHEMAS[1]), "json_schema", "</think>", 6))
    reqs = [_req(i, tok.encode(TEXTS[i % len(TEXTS)]), 96, c, stop_token_ids=eos) for i, c in enumerate(constraints)]
    reqs.append(_req(10, tok.encode("def add(a, b):"), 40))
    reqs.append(_req(11, tok.encode("while"), 40, sampler=SamplerConfig(temperature=0.8, top_k=20), seed=3))
    reqs.append(_req(12, tok.encode("import sys"), 40, sampler=SamplerConfig(temperature=1.0, top_p=0.9), seed=4))
    mtp, running = _run(deep_lane, reqs, stagger=2)
    assert running.counters.accepted > 20 and max(s.mtp_depth for s in mtp) == 3
    overlapped, running = _run(deep_lane, reqs, stagger=2, settings=EngineSettings(overlap=True))
    assert running.counters.overlapped_cycles > 0
    assert [s.tokens for s in overlapped] == [s.tokens for s in mtp]
    ar, _ = _run(deep_lane, [_req(r.request_id, r.prompt_ids, r.max_tokens, r.constraint, stop_token_ids=eos,
                                  speculative=False) for r in reqs[:len(constraints)]])
    for i, c in enumerate(constraints):
        assert mtp[i].tokens == ar[i].tokens, i
        assert mtp[i].finish_reason == "stop", (i, tok.decode(mtp[i].tokens))
        if c.think_end is None:
            assert mtp[i].tokens == _oracle(model, llg_tokenizer, reqs[i].prompt_ids, c.grammar, 96), i
    for i, schema in enumerate(SCHEMAS):
        jsonschema.validate(json.loads(tok.decode(mtp[i].tokens)), schema)
    thought = tok.decode(mtp[4].tokens)
    reasoning, answer = thought.split("</think>", 1)
    assert len(tok.encode(reasoning)) >= 1
    jsonschema.validate(json.loads(answer), SCHEMAS[1])


def test_a_row_out_of_tokens_ends_with_length(model, deep_lane):
    tok = model.tokenizer
    c = Constraint(json_schema_grammar(SCHEMAS[0]), "json_schema")
    [s], _ = _run(deep_lane, [_req(0, tok.encode("x = "), 5, c)])
    assert s.finish_reason == "length" and len(s.tokens) == 5 and tok.decode(s.tokens).startswith("{")


def _restricted_joint(model, llg_tokenizer, ids, grammar, cfg, depth):
    """The exact joint of a constrained row's first `depth` tokens: at each position the
    target's distribution restricted to what the grammar allows after the tokens before."""
    import llguidance
    import llguidance.numpy

    bits = llguidance.numpy.allocate_token_bitmask(1, llg_tokenizer.vocab_size)

    def dist(seq):
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
        assert all(matcher.consume_token(t) for t in seq)
        llguidance.numpy.fill_next_token_bitmask(matcher, bits)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:model.vocab_size].astype(bool)
        logits = np.array(model.logits(model.hidden(mx.array([list(ids) + seq]), model.make_cache()))[0, -1])
        return row_distribution(np.where(allowed, logits, -np.inf).astype(np.float32), cfg), allowed

    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for seq, p in joint.items():
            d, _ = dist(list(seq))
            nxt.update({seq + (t,): p * float(w) for t, w in zip(d.ids.tolist(), d.probs)})
        joint = nxt
    return joint, dist


def test_sampled_constrained_rows_keep_the_restricted_joint(model, llg_tokenizer):
    """Seeded sampled rows under a regex, chaining two drafts from a draft sampler unlike the
    target, in a B8 lane beside unconstrained rows of other settings joining at other times:
    (t1, t2, t3) follows the exact joint of the target restricted by the grammar, renormalised.
    Chi-square at a false-alarm rate of 1e-4; power: with every draft accepted, (t1, t2) would
    follow the restricted draft distribution instead, far past the critical value."""
    from test_sampling import ALPHA, chi2_test

    cfg = SamplerConfig(temperature=1.0, top_k=3, top_p=1.0)
    draft = SamplerConfig(temperature=1.5, top_k=4, top_p=1.0)
    grammar = regex_grammar(r"[a-z]+(_[a-z]+)*")
    ids = model.tokenizer.encode("def ")
    joint, dist = _restricted_joint(model, llg_tokenizer, ids, grammar, cfg, 3)
    assert 6 <= len(joint) <= 27
    lane = install_a3b_mtp_batch_lane(model, 8, depth=2, selfcheck=False)
    running = RunningLane(lane, sampled_ladder=[lane])
    n, streams = 600, []
    neighbours = [SamplerConfig(temperature=0.0), SamplerConfig(temperature=0.7, top_p=0.9)]
    for s in range(n):
        streams.append(running.add(_req(f"c{s}", ids, 3, Constraint(grammar, "regex"), sampler=cfg, seed=s,
                                        draft_sampler=draft, prefill_group="seeded")))
        if s % 50 == 0:
            running.add(_req(f"n{s}", model.tokenizer.encode("import"), 12, sampler=neighbours[s % 2], seed=s))
        if len(streams) % 6 == 0:
            running.step()
    while running.has_work:
        running.step()
    counts = Counter(tuple(st.tokens) for st in streams)
    assert running.counters.peak_rows == 8 and sum(st.accepted_drafts for st in streams) > 100
    assert max(st.mtp_depth for st in streams) == 2
    p_value, df = chi2_test(counts, joint)
    assert df >= 3 and p_value > ALPHA, (p_value, df, counts)
    # power: every draft accepted puts t2 | t1 at the head's restricted draft distribution
    bad = {}
    for t1 in {k[0] for k in joint}:
        _, allowed = dist([t1])
        g = model.draft_hidden(model.hidden(mx.array([list(ids)]), model.make_cache())[:, -1:], mx.array([[t1]]),
                               model.make_mtp_cache())
        q_logits = np.array(model.logits(g)[0, -1])
        q = row_distribution(np.where(allowed, q_logits, -np.inf).astype(np.float32), draft)
        p1 = sum(v for k, v in joint.items() if k[0] == t1)
        bad.update({(t1, t2): p1 * float(w) for t2, w in zip(q.ids.tolist(), q.probs)})
    pairs: dict = {}
    for k, v in joint.items():
        pairs[k[:2]] = pairs.get(k[:2], 0.0) + v
    outside = sum(v for k, v in bad.items() if k not in pairs)
    lam = n * (sum((bad.get(k, 0.0) - v) ** 2 / v for k, v in pairs.items()) + (1e9 if outside > 0.01 else 0.0))
    assert lam > 100, lam


def test_thinking_budget_forces_the_end_marker(model, deep_lane):
    """A budget without a grammar: the row thinks freely for the budget, then the marker is
    forced token by token; afterwards it is free again. Same tokens MTP and AR."""
    tok = model.tokenizer
    c = Constraint(None, "thinking", "</think>", 10)
    reqs = [_req(0, tok.encode("<think>\n"), 30, c)]
    [mtp], _ = _run(deep_lane, reqs)
    [ar], _ = _run(deep_lane, [_req(0, reqs[0].prompt_ids, 30, c, speculative=False)])
    assert mtp.tokens == ar.tokens
    text = tok.decode(mtp.tokens)
    assert "</think>" in text and len(tok.encode(text.split("</think>")[0])) <= 10


def _held_back_oracle(model, ids, stops, min_tokens, n):
    """mlx-lm's greedy `generate_step`, the stop tokens masked while fewer than `min_tokens`
    tokens are out; up to and including the first stop token."""
    from mlx_lm.generate import generate_step

    banned = mx.array(np.isin(np.arange(model.vocab_size), sorted(stops)))

    def processor(tokens, logits):
        return mx.where(banned[None], -mx.inf, logits) if tokens.size - len(ids) < min_tokens else logits

    out = []
    for token, _ in generate_step(mx.array(list(ids)), model.target, max_tokens=n, logits_processors=[processor]):
        out.append(int(token))
        if out[-1] in stops:
            break
    return out


def test_min_tokens_holds_the_stop_tokens_back(model, deep_lane, llg_tokenizer):
    """vLLM's `min_tokens`: the row's stop tokens (EOS and a token its free text writes early) are not allowed
    among its first `min_tokens` tokens. Greedy rows in a depth-3 lane beside unconstrained and
    sampled rows: MTP equals AR and mlx-lm with the same mask; the stop comes after the
    minimum; once past it the row is an unconstrained row again (no grammar left). Under a grammar,
    the grammar's end still ends the row."""
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ("import os\n", "x = 1\n", "def add(a, b):")]
    # each row's stop: a token its free greedy text first writes at position 2 or later
    free = [s.tokens for s in _run(deep_lane, [_req(f"f{i}", ids, 40) for i, ids in enumerate(prompts)])[0]]
    first = [next(k for k in range(2, 40) if t[k] not in t[:k]) for t in free]
    stops = [frozenset(model.eos_token_ids) | {t[k]} for t, k in zip(free, first)]
    minimum = [k + 6 for k in first]
    assert [s.tokens for s in _run(deep_lane, [_req(f"f{i}", ids, 40, stop_token_ids=st) for i, (ids, st)
                                               in enumerate(zip(prompts, stops))])[0]] == [t[:k + 1] for t, k in
                                                                                           zip(free, first)]
    held = [_req(f"h{i}", ids, 40, holding_back(None, st, m), stop_token_ids=st)
            for i, (ids, st, m) in enumerate(zip(prompts, stops, minimum))]
    neighbours = [_req("g", tok.encode("class A:\n"), 30),
                  _req("s", tok.encode("while"), 30, sampler=SamplerConfig(temperature=0.8, top_k=20), seed=3)]
    mtp, running = _run(deep_lane, held + neighbours, stagger=2)
    assert running.counters.accepted > 10
    ar, _ = _run(deep_lane, [_req(r.request_id, r.prompt_ids, 40, r.constraint, stop_token_ids=r.stop_token_ids,
                                  speculative=False) for r in held])
    for i, (ids, st, m) in enumerate(zip(prompts, stops, minimum)):
        assert mtp[i].tokens == ar[i].tokens == _held_back_oracle(model, ids, st, m, 40), i
        assert not st & set(mtp[i].tokens[:m]) and len(mtp[i].tokens) > m, (i, mtp[i].tokens)
    alone, _ = _run(deep_lane, neighbours)
    assert [s.tokens for s in mtp[len(held):]] == [s.tokens for s in alone]
    # sampled rows: a seeded row held back in a lane as alone, and never stopped before its minimum
    hot = SamplerConfig(temperature=1.0, top_k=8)
    sampled = [_req(f"t{i}", prompts[i % 3], 24, holding_back(None, stops[i % 3], 8), sampler=hot, seed=i,
                    stop_token_ids=stops[i % 3]) for i in range(6)]
    together, _ = _run(deep_lane, sampled + neighbours, stagger=1)
    for i, r in enumerate(sampled):
        [solo], _ = _run(deep_lane, [r])
        assert together[i].tokens == solo.tokens and not r.stop_token_ids & set(solo.tokens[:8]), i
    # a grammar's end wins: a choice grammar finished at 1-2 tokens still stops the row
    c = holding_back(Constraint(choice_grammar(["yes", "no"]), "choice"), stops[0], 30)
    [done], _ = _run(deep_lane, [_req(0, tok.encode("ok = "), 40, c, stop_token_ids=stops[0])])
    assert done.finish_reason == "stop" and tok.decode(done.tokens).strip() in ("yes", "no")


def test_a_held_back_row_drops_its_constraint_after_the_minimum(model):
    from mtplx.engine.row import LaneRow

    stops = frozenset(model.eos_token_ids)
    row = LaneRow(_req(0, (1, 2, 3), 10, holding_back(None, stops, 2), stop_token_ids=stops), model.vocab_size,
                  grammar_tokenizer=None)
    assert not row.allowed()[sorted(stops)].any() and row.allowed().sum() == model.vocab_size - len(stops)
    assert not row.grammar.allows(sorted(stops)[0]) and row.grammar.allows(5)
    row.emit(5)
    assert row.grammar is not None
    row.emit(6)
    assert row.grammar is None and row.allowed() is None and row.live
    assert holding_back(None, stops, 0) is None and holding_back(None, (), 4) is None


@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {"type": "string"}}}}},
     "/properties/a/items/not"),
    ({"type": "object", "properties": {"a": {"type": "strng"}}}, "/properties/a/type"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "colour"}}}, "/properties/a/format"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/properties/a/$ref"),
    ({"type": "string", "pattern": "(?<=a)b"}, None),
])
def test_bad_schemas_are_refused_with_their_place(llg_tokenizer, schema, where):
    with pytest.raises(ConstraintError) as err:
        check_constraint(Constraint(json_schema_grammar(schema), "json_schema"), llg_tokenizer, schema=schema)
    if where is not None:
        assert where in str(err.value) and err.value.where.endswith(where)


def test_thinking_before_a_grammar_never_runs_past_its_marker(model, llg_tokenizer):
    """While a row thinks before a grammar, no token may complete the end marker and go on past
    it (those bytes would escape the grammar): after "</think" the token ">" is allowed, ">>" is
    not; once the marker is out, the grammar holds."""
    tok = model.tokenizer
    grammar = _object_after_thinking(llg_tokenizer, model.vocab_size)
    for t in tok.encode("hmm </think"):
        grammar.consume(t)
    mask = grammar.allowed()
    words = {i: llg_tokenizer.decode_bytes([i]) for i in range(model.vocab_size)}
    refused = {w for i, w in words.items() if not mask[i]}
    assert b">" not in refused and b">>" in refused and all(w.startswith(b">") for w in refused)
    grammar.consume(tok.encode(">")[0])
    assert not grammar.thinking and not grammar.allows(tok.encode("x")[0]) and grammar.allows(tok.encode("{")[0])


def _object_after_thinking(llg_tokenizer, vocab):
    """A row's grammar: any JSON object, after thinking that ends at "</think>"."""
    from mtplx.structured import RowGrammar

    return RowGrammar(Constraint(json_schema_grammar({"type": "object"}), "json_schema", "</think>"), llg_tokenizer,
                      vocab)


def test_regex_errors_say_what_is_wrong(llg_tokenizer):
    with pytest.raises(ConstraintError, match="unclosed character class"):
        check_constraint(Constraint(regex_grammar("[a-"), "regex"), llg_tokenizer)


def test_a_rows_grammar_keeps_no_mask_behind_it(model, llg_tokenizer):
    """Masks are kept by position only from the committed one on: a long row does not pile up
    one vocabulary-sized mask per token."""
    from mtplx.structured import RowGrammar

    grammar = RowGrammar(Constraint(json_schema_grammar(SCHEMAS[0]), "json_schema"), llg_tokenizer,
                         model.vocab_size)
    for t in model.tokenizer.encode('{"name":"ab","age":7,"tags":["a","bb"]}'):
        assert grammar.allowed()[t]
        grammar.consume(t)
        assert len(grammar._masks) <= 1
    assert grammar.ended


def test_grammar_memory_is_counted_per_row_and_bounded(model, deep_lane, llg_tokenizer):
    """What the live rows' grammars hold is counted as it changes (the replica's snapshot reports
    it): each row's masks and bitmask buffer, never more than a mask for each position it has
    speculated past plus one; given back when the row ends. llguidance's own memory is bounded by
    the parser limits every grammar is compiled under."""
    import gc

    from mtplx import structured
    from mtplx.structured import GRAMMAR_MEMORY, RowGrammar

    limits = structured.parser_limits()
    assert (limits.step_lexer_fuel, limits.initial_lexer_fuel, limits.max_lexer_states) == (
        structured.STEP_LEXER_FUEL, structured.INITIAL_LEXER_FUEL, structured.MAX_LEXER_STATES)
    gc.collect()
    before = GRAMMAR_MEMORY.stats()
    grammar = RowGrammar(Constraint(json_schema_grammar(SCHEMAS[0]), "json_schema"), llg_tokenizer, model.vocab_size)
    assert GRAMMAR_MEMORY.stats()["live_rows"] == before["live_rows"] + 1
    text = model.tokenizer.encode('{"name":"ab","age":7,"tags":["a"]}')
    for t in text[:3]:                       # committed
        grammar.allowed()
        grammar.consume(t)
    for t in text[3:7]:                      # a cycle's primary and three drafts, speculated
        grammar.allowed()
        grammar.speculate(t)
    grammar.allowed()
    held = grammar.memory_bytes
    bits = (llg_tokenizer.vocab_size + 31) // 32 * 4
    assert held == bits + sum(m.nbytes for m in grammar._masks.values() if m is not None)
    assert GRAMMAR_MEMORY.stats()["row_bytes"] - before["row_bytes"] == held > bits
    grammar.unwind()                         # kept for the tokens the row may emit again
    assert grammar.memory_bytes <= bits + 6 * model.vocab_size
    for t in text[3:]:
        grammar.allowed()
        grammar.consume(t)
    assert grammar.memory_bytes <= bits + 2 * model.vocab_size
    del grammar
    gc.collect()
    after = GRAMMAR_MEMORY.stats()
    assert after["live_rows"] == before["live_rows"] and after["row_bytes"] == before["row_bytes"]
    assert after["peak_row_bytes"] >= held and after["lexer_bytes_bound_per_grammar"] > 0
    # through a depth-3 lane: rows start and end, each held at most a few masks
    tok = model.tokenizer
    reqs = [_req(i, tok.encode(TEXTS[i]), 24, Constraint(json_schema_grammar(s), "json_schema"))
            for i, s in enumerate(SCHEMAS)]
    _run(deep_lane, reqs)
    gc.collect()
    done = GRAMMAR_MEMORY.stats()
    assert done["rows_started"] >= after["rows_started"] + len(SCHEMAS) and done["live_rows"] == before["live_rows"]
    assert done["peak_row_bytes"] <= bits + (3 + 2) * model.vocab_size
