"""Gemma 3 text (`gemma3_text`) served exactly: sliding-window and global layers, Gemma's norms,
scaled embeddings, tied or untied head, against an oracle that shares no code with ours
(DESIGN.md, exactness contract 6): mlx-lm's own `gemma3_text` model and `generate_step`, decoding
with its `RotatingKVCache`s from a copy of the checkpoint without `mtp.*` tensors.

Two small random checkpoints, float32, built here with the real model's layer pattern (7 layers,
every 6th global) and a window of 8, so that prompts (1-300 tokens, prefill chunks of 256) and
generations cross it:
- "agree": an untied head and a random MTP head made to agree part of the time (each residual
  branch scaled down through its post-norm's `1 + w`, the head's `fc` passing the embedding
  through), so that drafts are accepted and rejected at every depth: verify and rollback run;
- "plain": tied embeddings and no `mtp.*` weights, as Gemma 3 270M is today: AR rows in
  running lanes. Its branches are full size, so the window changes its tokens.
With MTPLX_GEMMA_DIR set to a converted Gemma 3 checkpoint, the last tests run it against mlx-lm
too (greedy AR and a width-8 lane).
"""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load as mlx_lm_load

import mtplx
from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.installed import ar_lanes
from mtplx.engine.lane import RunningLane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.models import gemma3
from mtplx.models.cache import RaggedKVCache, commit_rows, window_band
from mtplx.models.loader import SHIPPED_MODEL, _architectures
from mtplx.models.mtp_head import MTPHead
from mtplx.sampling import GREEDY
from mtplx.scheduler.session_bank import SessionBank

VOCAB = 4096                    # the shipped tokenizer's
WINDOW = 8
TOKENS = 40
CONFIG = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=7, intermediate_size=128,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
              rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=32, sliding_window=WINDOW,
              sliding_window_pattern=6, max_position_embeddings=1024, eos_token_id=[1])
POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
LENGTHS = (1, 5, 300, 40, 2, 17, 9, 64, 12, 33)      # prompt lengths: below, at and past the window; chunked


def _checkpoint(root: Path, name: str, tied: bool, head: bool, branch: float, seed: int = 0):
    """(full checkpoint dir, target-only dir for mlx-lm). `branch`: every residual branch's scale,
    set through its post-norm (Gemma normalises a branch's output, so scaling o_proj or down_proj
    would not reach it)."""
    mx.random.seed(seed)
    cfg = dict(CONFIG, tie_word_embeddings=tied, **({"mtp_num_hidden_layers": 1} if head else {}))
    model_cls, args_cls = _get_classes(cfg)
    target = model_cls(args_cls.from_dict(cfg))
    mtp = MTPHead(64, 1e-6, lambda: gemma3.make_mtp_block(target.args))
    for mod in (target, mtp):
        mod.update(tree_unflatten([(k, mx.full(v.shape, branch - 1.0)) for k, v in tree_flatten(mod.parameters())
                                   if k.endswith(POST_NORMS)]))
    mtp.fc.weight = mx.concatenate([mx.eye(64), mx.zeros((64, 64))], axis=1)
    weights = {k: v for k, v in tree_flatten(target.parameters()) if not (tied and k.startswith("lm_head."))}
    dirs = []
    for sub, extra in ((name, head), (name + "-target", False)):
        d = root / sub
        d.mkdir()
        w = dict(weights, **({f"mtp.{k}": v for k, v in tree_flatten(mtp.parameters())} if extra else {}))
        mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "mlx"})
        (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                   if extra or k != "mtp_num_hidden_layers"}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SHIPPED_MODEL / f, d / f)
        dirs.append(d)
    return dirs


class Oracle:
    """mlx-lm alone: its model from the target-only copy, greedy `generate_step`, references
    kept per prompt (greedy n tokens are the first n of any longer run)."""

    def __init__(self, path: Path):
        self.lm, _ = mlx_lm_load(str(path))
        self.runs: dict = {}

    def greedy(self, ids, n: int) -> list:
        key = tuple(int(t) for t in ids)
        if len(self.runs.get(key, ((), ()))[0]) < n:
            steps = list(generate_step(mx.array(list(key)), self.lm, max_tokens=n))
            self.runs[key] = ([int(t) for t, _ in steps], [lp for _, lp in steps])
        return self.runs[key][0][:n]

    def logprobs(self, ids, n: int) -> list:
        self.greedy(ids, n)
        return self.runs[tuple(int(t) for t in ids)][1][:n]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    agree, agree_target = _checkpoint(root, "agree", tied=False, head=True, branch=0.1)
    plain, _ = _checkpoint(root, "plain", tied=True, head=False, branch=1.0, seed=1)
    return {"agree": (mtplx.load_model(agree), Oracle(agree_target)),
            "plain": (mtplx.load_model(plain), Oracle(plain))}


def _prompts(n, seed=1, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


def _req(i, ids, n, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=ids, sampler=GREEDY, max_tokens=n, **kw)


def _drain(running):
    while running.has_work:
        running.step()


# ------------------------------------------------------------------ loading

def test_loads_as_gemma3_with_full_caches_and_mlx_lm_classes(gemma):
    m, oracle = gemma["agree"]
    assert m.arch is gemma3 and _architectures()["gemma3_text"] is gemma3
    assert m.mtp is not None and m.vocab_size == VOCAB
    assert type(m.mtp.layers[0]) is gemma3_text.TransformerBlock and not m.mtp.layers[0].self_attn.is_sliding
    layers = m.target.model.layers
    assert [ly.self_attn.is_sliding for ly in layers] == [True] * 5 + [False, True]
    assert all(type(ly.self_attn) is gemma3.Attention for ly in layers)
    assert all(type(c) is KVCache for c in m.make_cache())      # the window is a mask over full caches
    assert not m.target.tie_word_embeddings and gemma["plain"][0].target.tie_word_embeddings
    # the oracle is mlx-lm's own model, with its rotating caches on the sliding layers
    assert type(oracle.lm.model.layers[0].self_attn) is gemma3_text.Attention
    assert [type(c) for c in make_prompt_cache(oracle.lm)] == [RotatingKVCache] * 5 + [KVCache, RotatingKVCache]
    plain = gemma["plain"][0]
    assert plain.mtp is None and "no mtp.* weights" in plain.mtp_disabled_reason
    # the embedding the head takes is the one the first layer sees (scaled by sqrt(hidden))
    tokens = mx.array([[5, 6]])
    assert mx.allclose(m.embed(tokens), m.target.model.embed_tokens(tokens) * 8.0).item()


# ------------------------------------------------------------------ the window at the cache level

def _reference_logits(lm, prefix: list, tokens: list) -> np.ndarray:
    """mlx-lm's logits at each of `tokens` after `prefix`, decoded as `generate_step` does: the
    prefix in one forward, then one token at a time through its rotating caches."""
    cache = make_prompt_cache(lm)
    lm(mx.array([prefix]), cache)
    return np.stack([np.array(lm(mx.array([[t]]), cache)[0, -1]) for t in tokens])


def test_verify_and_rollback_see_exactly_the_window(gemma, monkeypatch):
    """Rows of different lengths (below and past the window) in one ragged lane cache verify 4
    positions at a time; each row keeps 0-4 of them (rejected drafts rolled back), six rounds.
    At every verify position of every row the logits equal mlx-lm's, decoded token by token with
    its own rotating caches, to float32 rounding (mlx-lm's own [1, 4] and [1, 1] forwards differ
    by ~1e-5 here): with the sliding layers reading each row's window band (the engine's path),
    and reading the whole span under the window mask. Power: with the window ignored they
    differ by far more."""
    m, oracle = gemma["plain"]
    prompts = _prompts(4, seed=3, lengths=(3, 9, 14, 30))
    per_row = []
    for p in prompts:
        c = m.make_cache()
        m.hidden(mx.array([p]), c)
        per_row.append(c)

    def run():
        layers = [RaggedKVCache.empty_rows(len(prompts)) for _ in per_row[0]]
        for b, caches in enumerate(per_row):
            for layer, kv in zip(layers, caches):
                layer.put_row(b, kv)
        seqs, worst, rng = [list(p) for p in prompts], 0.0, np.random.default_rng(7)
        for _ in range(6):
            tokens = rng.integers(3, VOCAB, size=(len(prompts), 4))
            got = np.array(m.logits(m.hidden(mx.array(tokens), layers)))
            for b, seq in enumerate(seqs):
                ref = _reference_logits(oracle.lm, seq, tokens[b].tolist())
                worst = max(worst, float(np.max(np.abs(got[b] - ref) / (1 + np.abs(ref)))))
            keep = rng.integers(0, 5, size=len(prompts))
            commit_rows(layers, 4, keep)
            for b, k in enumerate(keep):
                seqs[b] += tokens[b, :k].tolist()
        assert [int(n) for n in layers[0].lengths] == [len(s) for s in seqs]
        assert min(len(p) for p in prompts) < WINDOW < min(len(s) for s in seqs)
        return worst

    bands = []
    monkeypatch.setattr(gemma3, "window_band", lambda *a: bands.append(window_band(*a)) or bands[-1])
    assert run() < 1e-4 and any(b is not None for b in bands)      # the band
    for layer in m.target.model.layers:
        monkeypatch.setattr(layer.self_attn, "window", 0)
    assert run() < 1e-4                                             # the whole span, window mask
    make_mask = RaggedKVCache.make_mask
    monkeypatch.setattr(RaggedKVCache, "make_mask", lambda self, N, return_array=False, window_size=None:
                        make_mask(self, N, return_array))
    assert run() > 1e-2                                             # no window


def test_window_band_is_the_masked_span():
    """`window_band`: per row, the positions it keeps are the window's (as many as the span's
    mask lets through), and attention over the band equals attention over the whole span under
    the window mask; one row (an int offset) slices the same band; a span too short to pay for
    a band is left as it is."""
    rng = np.random.default_rng(0)
    W, T, lengths = 5, 3, [0, 3, 9, 20]
    k = mx.array(rng.normal(size=(4, 1, 32, 8)).astype(np.float32))
    v = mx.array(rng.normal(size=(4, 1, 32, 8)).astype(np.float32))
    q = mx.array(rng.normal(size=(4, 2, T, 8)).astype(np.float32))
    cache = RaggedKVCache(k, v, lengths)
    keys, values = cache.update_and_fetch(k[:, :, :T], v[:, :, :T])
    mask = RaggedKVCache(k, v, lengths).make_mask(T, window_size=W)
    bk, bv, bm = window_band(cache, keys, values, mask, mx.array(lengths), W)
    assert bk.shape[2] == W + T - 1 and int(mx.sum(bm)) == int(mx.sum(mask[..., :keys.shape[2]]))
    full = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask=mask)
    band = mx.fast.scaled_dot_product_attention(q, bk, bv, scale=0.3, mask=bm)
    assert mx.allclose(full, band, atol=1e-6).item()
    one = window_band(None, keys[3:], values[3:], mask[3:], lengths[3], W)
    assert all(mx.array_equal(a, b).item() for a, b in zip(one, (bk[3:], bv[3:], bm[3:])))
    assert window_band(cache, keys, values, mask, mx.array(lengths), 16) is None


def test_window_mask_per_row_and_position():
    """The ragged cache's window mask: query i of row b (position offset_b + i) sees keys
    (q - W, q], mlx-lm's `create_causal_mask` rule, per row."""
    from mlx_lm.models.base import create_causal_mask

    lengths = [0, 3, 7, 12]
    k = mx.zeros((4, 1, 16, 2))
    cache = RaggedKVCache(k, k, lengths)
    mask = np.array(cache.make_mask(4, window_size=5))[:, 0]
    for b, n in enumerate(lengths):
        ref = np.array(create_causal_mask(4, n, window_size=5))
        assert (mask[b][:, :n + 4] == ref).all() and not mask[b][:, n + 4:].any()


# ------------------------------------------------------------------ solo decoding

@pytest.mark.parametrize("kind", ["agree", "plain"])
def test_greedy_ar_matches_mlx_lm(gemma, kind):
    m, oracle = gemma[kind]
    for ids in _prompts(4, seed=11, lengths=(1, 9, 300, 40)):
        assert generate_ar(m, ids, TOKENS, GREEDY).tokens == oracle.greedy(ids, TOKENS), len(ids)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_mtp_matches_mlx_lm(gemma, depth):
    m, oracle = gemma["agree"]
    accepted = rejected = 0
    for ids in _prompts(4, seed=11, lengths=(1, 9, 300, 40)):
        r = generate_mtpk(m, ids, TOKENS, GREEDY, depth=depth)
        assert r.tokens == oracle.greedy(ids, TOKENS), (depth, len(ids))
        accepted += r.stats["accepted_drafts"]
        rejected += r.stats["rejected_drafts"]
    assert accepted > 0 and rejected > 0         # drafts kept and rolled back


# ------------------------------------------------------------------ running lanes

def _staggered(running, reqs, every: int = 3) -> list:
    """Two rows at once (they prefill together), then one more every `every` steps: rows join
    the running lane mid-flight."""
    streams = [running.add(r) for r in reqs[:2]]
    for r in reqs[2:]:
        for _ in range(every):
            running.step()
        streams.append(running.add(r))
    _drain(running)
    return streams


def _seeded_rows_each_as_if_alone(m, settings, seed: int = 61) -> tuple:
    """Seeded rows of these settings (depth 2), each decoded alone in the one-row lane, then
    together in a width-8 lane, joining mid-flight: (the lane's streams, the alone ones), each
    row asserted to have the same tokens either way."""
    from mtplx.engine.installed import solo_lane

    prompts = _prompts(len(settings), seed=seed)
    reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=c, seed=10 + i, max_tokens=30)
            for i, (p, c) in enumerate(zip(prompts, settings))]
    alone = []
    for r in reqs:
        one = RunningLane(solo_lane(m, 2))
        alone.append(one.add(r))
        _drain(one)
    lane = install_a3b_mtp_batch_lane(m, 8, depth=2, selfcheck=False)
    streams = _staggered(RunningLane(lane, sampled_ladder=[lane]), reqs, every=2)
    for i, (s, ref) in enumerate(zip(streams, alone)):
        assert s.tokens == ref.tokens, f"row {i} ({settings[i]})"
    return streams, alone


def test_width8_lane_rows_joining_mid_flight_match_mlx_lm_mtp(gemma):
    """MTP rows (depth 2) join a width-8 lane (widening from 3) mid-flight, prompts of 1-300
    tokens (chunked prefill, some prefilled together), budgets ending at different cycles: each
    row is mlx-lm's greedy text."""
    m, oracle = gemma["agree"]
    lanes = [install_a3b_mtp_batch_lane(m, w, depth=2) for w in (3, 8)]
    assert all(ln.selfcheck["ok"] for ln in lanes), [ln.selfcheck for ln in lanes]
    prompts = _prompts(10, seed=21)
    budgets = [TOKENS - 3 * (i % 4) for i in range(10)]
    running = RunningLane(lanes)
    streams = _staggered(running, [_req(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))])
    assert running.counters.peak_rows == 8 and running.counters.batched_prefills > 0
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert streams[i].tokens == oracle.greedy(p, n), f"row {i} (prompt {len(p)})"
    assert running.counters.accepted > 0 and running.counters.rejected > 0
    assert streams[-1].admitted_at_cycle > 0
    # the cycles ran as compiled graphs (the window band inside them), none fell back to eager
    assert any(isinstance(key, tuple) and key[0] == "verify" for ln in lanes for key in ln._graphs)
    assert not any("eager_since" in ln._graphs for ln in lanes)


def test_width8_lane_of_ar_rows_matches_mlx_lm_without_a_head(gemma):
    """The checkpoint without a head (Gemma 3 270M today) serves AR rows in running lanes
    (`ar_lanes`, `speculative=False`): ten rows join a width-8 lane mid-flight; each row is
    mlx-lm's greedy text, and its logprobs are mlx-lm's to 1e-4."""
    m, oracle = gemma["plain"]
    with pytest.raises(ValueError, match="no MTP head"):
        generate_mtpk(m, [5, 6], 4, GREEDY)
    prompts = _prompts(10, seed=31)
    budgets = [TOKENS - 3 * (i % 4) for i in range(10)]
    running = RunningLane(ar_lanes(m, [3, 8]))
    reqs = [_req(i, p, n, speculative=False, logprobs=2 if i % 3 == 0 else None)
            for i, (p, n) in enumerate(zip(prompts, budgets))]
    streams = _staggered(running, reqs)
    assert running.counters.peak_rows == 8 and running.counters.batched_prefills > 0
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert streams[i].tokens == oracle.greedy(p, n), f"row {i} (prompt {len(p)})"
        if reqs[i].logprobs is not None:
            ref = oracle.logprobs(p, n)
            assert len(streams[i].logprobs) == n
            for t, (lp, alts), ref_lp in zip(streams[i].tokens, streams[i].logprobs, ref):
                assert abs(lp - float(ref_lp[t])) < 1e-4
                top = np.argsort(-np.array(ref_lp), kind="stable")[:2].tolist()
                assert [a for a, _ in alts] == top
                assert np.allclose([v for _, v in alts], [float(ref_lp[a]) for a in top], atol=1e-4)


def test_sampled_rows_in_a_width8_lane_are_each_as_if_alone(gemma):
    """Seeded sampled rows (their own settings, chaining 2 drafts: residual resamples and
    rollbacks across the window) beside greedy rows in a width-8 lane, joining mid-flight: each
    row's tokens are the same request's decoded alone in the one-row lane (contract 4)."""
    from mtplx.sampling import SamplerConfig

    m, oracle = gemma["agree"]
    settings = [SamplerConfig(temperature=0.8), GREEDY, SamplerConfig(temperature=1.0, top_p=0.9),
                SamplerConfig(temperature=0.6, top_k=20), GREEDY, SamplerConfig(temperature=0.7, min_p=0.05)]
    streams, alone = _seeded_rows_each_as_if_alone(m, settings)
    assert sum(s.rejected_drafts for i, s in enumerate(streams) if not settings[i].is_greedy) > 0
    prompts = _prompts(len(settings), seed=61)
    for i in (1, 4):
        assert streams[i].tokens == oracle.greedy(prompts[i], 30)


def test_prefix_reuse_restores_windowed_caches(gemma):
    """A prompt sharing its first 256+ tokens with an earlier one restores the banked chunk
    boundary (the full caches, windows past 256 included), the same prompt again its whole
    prefill; both decode mlx-lm's text, solo and in a lane."""
    m, oracle = gemma["agree"]
    bank = SessionBank("gemma")
    base = _prompts(1, seed=41, lengths=(290,))[0]
    p1, p2 = base + [7, 8], base + [9, 10, 11]
    generate_mtpk(m, p1, 8, GREEDY, session_restore=lambda: bank.lookup(p1), session_commit=bank.commit)
    warm = generate_mtpk(m, p2, TOKENS, GREEDY, session_restore=lambda: bank.lookup(p2), session_commit=bank.commit)
    assert warm.stats["cached_tokens"] == 256 and warm.tokens == oracle.greedy(p2, TOKENS)
    again = generate_mtpk(m, p2, TOKENS, GREEDY, session_restore=lambda: bank.lookup(p2), session_commit=bank.commit)
    assert again.stats["cached_tokens"] == len(p2) and again.tokens == oracle.greedy(p2, TOKENS)
    lane = install_a3b_mtp_batch_lane(m, 3, selfcheck=False)
    reqs = []
    for i, p in enumerate((p1, p2, base + [12])):
        restore, commit = bank.hooks(p)
        reqs.append(_req(i, p, 24, session_restore=restore, session_commit=commit))
    res = generate_a3b_mtp_batch(lane, reqs)
    assert [s.cached_tokens for s in res.streams] == [len(p1), len(p2), 256]
    assert [s.tokens for s in res.streams] == [oracle.greedy(r.prompt_ids, 24) for r in reqs]


def test_prefix_reuse_of_ar_rows_without_a_head(gemma):
    """The checkpoint without a head (served as AR rows) banks and restores prefixes too: a
    prompt sharing 256+ tokens with an earlier one restores the chunk boundary, the same prompt
    again its whole prefill, in a running lane of AR rows; every row is mlx-lm's text."""
    m, oracle = gemma["plain"]
    bank = SessionBank("gemma-plain")
    base = _prompts(1, seed=43, lengths=(290,))[0]
    prompts = [base + [7, 8], base + [9, 10, 11], base + [9, 10, 11], base[:100]]

    def run(ps):
        running = RunningLane(ar_lanes(m, [3]))
        reqs = []
        for i, p in enumerate(ps):
            restore, commit = bank.hooks(p)
            reqs.append(_req(i, p, 24, speculative=False, session_restore=restore, session_commit=commit))
        return _staggered(running, reqs, every=2)

    streams = run(prompts[:1]) + run(prompts[1:2]) + run(prompts[2:])
    assert [s.cached_tokens for s in streams] == [0, 256, len(prompts[2]), 0]
    for s, p in zip(streams, prompts):
        assert s.tokens == oracle.greedy(p, 24), len(p)


def test_the_service_serves_the_checkpoint_without_a_head_with_prefix_reuse(gemma):
    """`MTPBatchGenerationService.for_model` on the checkpoint without a head: a B8 lane of AR
    rows, a prefix bank of its own; a cohort of eight (three sharing a 280-token prefix with an
    earlier request) decodes mlx-lm's text, and the shared prefix is restored."""
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    m, oracle = gemma["plain"]
    base = _prompts(1, seed=47, lengths=(280,))[0]
    prompts = [base + [3 + i] for i in range(3)] + _prompts(5, seed=48)
    service = MTPBatchGenerationService.for_model(m, widths=(8,), batch_wait_s=0.05)
    try:
        service.submit(MTPBatchJob(request_id="w", prompt_ids=base + [99], max_tokens=4, sampler=GREEDY)).result(120)
        jobs = [MTPBatchJob(request_id=f"r{i}", prompt_ids=p, max_tokens=16, sampler=GREEDY)
                for i, p in enumerate(prompts)]
        results = [f.result(120) for f in service.submit_cohort(jobs)]
        bank = service.snapshot()["session_bank"]
    finally:
        service.shutdown(timeout_s=30)
    for r, p in zip(results, prompts):
        assert r["tokens"] == oracle.greedy(p, 16) and r["stats"]["generation_mode"] == "ar"
    assert [r["stats"]["cached_tokens"] for r in results[:3]] == [256] * 3 and bank["hits"] >= 3
    assert results[0]["stats"]["mtp_batch_real_width"] == 8


def test_structured_rows_in_a_gemma_lane_match_mlx_lm_under_the_grammar(gemma):
    """Constrained greedy rows (a regex, a JSON schema) beside free rows in a depth-3 lane: each
    equals its AR decoding under the grammar and mlx-lm's `generate_step` with the grammar's
    masks from a matcher of its own (`test_structured_lane._oracle`)."""
    from test_structured_lane import SCHEMAS, _oracle

    from mtplx.structured import Constraint, grammar_tokenizer, json_schema_grammar, regex_grammar

    m, oracle = gemma["agree"]
    llg = grammar_tokenizer(m.tokenizer, m.vocab_size)
    eos = frozenset(m.eos_token_ids)
    constraints = [Constraint(regex_grammar(r"(yes|no) because [a-z ]{1,20}\."), "regex"),
                   Constraint(json_schema_grammar(SCHEMAS[0]), "json_schema")]
    prompts = _prompts(4, seed=51, lengths=(12, 30, 5, 20))
    reqs = [_req(i, prompts[i], 64, constraint=c, stop_token_ids=eos) for i, c in enumerate(constraints)]
    reqs += [_req(2, prompts[2], 30), _req(3, prompts[3], 30)]
    lane = install_a3b_mtp_batch_lane(m, 8, depth=3, selfcheck=False)
    running = RunningLane(lane)
    mtp = _staggered(running, reqs, every=2)
    ar = _staggered(RunningLane(lane), [_req(r.request_id, r.prompt_ids, r.max_tokens, constraint=r.constraint,
                                             stop_token_ids=eos, speculative=False) for r in reqs[:2]])
    for i, c in enumerate(constraints):
        assert mtp[i].tokens == ar[i].tokens == _oracle(m, llg, prompts[i], c.grammar, 64), i
        assert mtp[i].finish_reason in ("stop", "length")
        if mtp[i].finish_reason == "stop" and c.kind == "json_schema":
            import jsonschema

            jsonschema.validate(json.loads(m.tokenizer.decode(mtp[i].tokens)), SCHEMAS[0])
    for i in (2, 3):
        assert mtp[i].tokens == oracle.greedy(prompts[i], 30), i
    assert running.counters.accepted > 0


# ------------------------------------------------------------------ the real converted weights

REAL = os.environ.get("MTPLX_GEMMA_DIR")
real_weights = pytest.mark.skipif(not REAL, reason="set MTPLX_GEMMA_DIR to a converted Gemma 3 checkpoint")


@pytest.fixture(scope="module")
def real_gemma():
    return mtplx.load_model(REAL), Oracle(Path(REAL))


def _real_prompts(m) -> list:
    texts = ["Once upon a time, in a small village,", "The capital of France is",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Photosynthesis is the process by which", "Here is a list of the planets in the solar system:",
             "The quick brown fox", "In 1969, the first humans", "To make a cup of tea, first"]
    # two prompts past the 512-token window (one past four prefill chunks): its sliding layers'
    # windows move at every position of their prefills and generations
    facts = ["The following is a list of numbered facts.\n"] + [
        f"{i}. The number {i} is {'even' if i % 2 == 0 else 'odd'}.\n" for i in range(1, 120)]
    texts += ["".join(facts[:60]), "".join(facts)]
    return [list(m.tokenizer.encode(t)) for t in texts]


@real_weights
def test_real_gemma_greedy_ar_matches_mlx_lm(real_gemma):
    m, oracle = real_gemma
    assert m.arch is gemma3
    for ids in _real_prompts(m)[:2]:
        assert ids[0] == m.tokenizer.bos_token_id            # Gemma needs its BOS
        assert generate_ar(m, ids, 32, GREEDY).tokens == oracle.greedy(ids, 32)


@real_weights
def test_real_gemma_width8_lane_matches_mlx_lm(real_gemma):
    m, oracle = real_gemma
    prompts = _real_prompts(m)
    assert len(prompts) == 10 and 512 < len(prompts[8]) < 1024 < len(prompts[9])
    running = RunningLane(ar_lanes(m, [8]))
    streams = _staggered(running, [_req(i, p, 24, speculative=False) for i, p in enumerate(prompts)], every=2)
    for i, p in enumerate(prompts):
        assert streams[i].tokens == oracle.greedy(p, 24), f"row {i}: {m.tokenizer.decode(streams[i].tokens)!r}"
