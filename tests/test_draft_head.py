"""A head stored beside a checkpoint that has none, drafting over a reduced vocabulary
(`mtplx/models/draft_head.py`), served exactly: greedy MTP is mlx-lm's greedy text at every depth,
solo and in a width-8 lane, constrained rows too; sampled rows keep the target's joint
distribution (chi-square with a power check) though the head's q is zero outside its vocabulary;
seeded rows reproduce. On a small random `gemma3_text` with Gemma 3 270M's layout (a window, every
6th layer global), its head file written by `save_head` as `mtplx train-head` writes it.
"""

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load as mlx_lm_load
from test_gemma3 import (POST_NORMS, VOCAB, Oracle, _checkpoint, _prompts, _req,
                         _seeded_rows_each_as_if_alone, _staggered)

import mtplx
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.settings import EngineSettings
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.models import gemma3
from mtplx.models.draft_head import CONFIG_KEY, DRAFT_FLOOR, HEAD_FILE, build_draft_vocab, remove_head, save_head
from mtplx.models.mtp_head import MTPHead
from mtplx.sampling import GREEDY, SamplerConfig

K = 256                       # the draft vocabulary: 1/16 of the target's
TOKENS = 40


def _agree_head(args, seed: int = 5) -> MTPHead:
    """A head that predicts the near-bigram target's next-next token part of the time: its branches
    scaled down through their post-norms, its fc passing the embedding through."""
    mx.random.seed(seed)
    head = MTPHead(64, 1e-6, lambda: gemma3.make_mtp_block(args))
    head.update(tree_unflatten([(k, mx.full(v.shape, -0.9)) for k, v in tree_flatten(head.parameters())
                                if k.endswith(POST_NORMS)]))
    head.fc.weight = mx.concatenate([mx.eye(64), mx.zeros((64, 64))], axis=1)
    mx.eval(head.parameters())
    return head


def _digest(d: Path) -> str:
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def _frequent_ids(m, k: int) -> list:
    """The k tokens the target writes most in greedy text from random prompts (ties: lower id),
    as train-head chooses them."""
    from mtplx.training.train_head import frequency_order

    written = [t for p in _prompts(12, seed=99, lengths=(3, 20, 7)) for t in generate_ar(m, p, 24, GREEDY).tokens]
    return np.sort(frequency_order(np.array(written), VOCAB)[:k]).tolist()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """(model with a reduced-vocabulary head beside it, mlx-lm oracle on the same directory, dir)."""
    root = tmp_path_factory.mktemp("draft_head")
    d, _ = _checkpoint(root, "reduced", tied=False, head=False, branch=0.1)
    before = _digest(d)
    m = mtplx.load_model(d)
    assert m.mtp is None
    save_head(d, _agree_head(m.target.args), _frequent_ids(m, K), {"trained_by": "the test"})
    assert _digest(d) == before            # the target's weights untouched
    return mtplx.load_model(d), Oracle(d), d


def test_the_loader_reads_the_head_beside_the_checkpoint_and_mlx_lm_ignores_it(reduced):
    m, oracle, d = reduced
    entry = json.loads((d / "config.json").read_text())[CONFIG_KEY]
    assert entry["file"] == HEAD_FILE and entry["draft_vocab_size"] == K and entry["trained_by"] == "the test"
    assert m.mtp is not None and m.draft_vocab is not None and m.draft_vocab.size == K
    assert type(m.mtp.layers[0].self_attn) is gemma3.Attention and not m.mtp.layers[0].self_attn.is_sliding
    # mlx-lm loads the same directory as the target alone (the oracle below is that model)
    lm, _ = mlx_lm_load(str(d))
    x = mx.array([[5, 6, 7]])
    assert mx.allclose(lm(x), m.logits(m.hidden(x)), atol=1e-5).item()
    # taken away again, the checkpoint is what it was
    copy = d.parent / "reduced-copy"
    shutil.copytree(d, copy)
    assert remove_head(copy) and not (copy / HEAD_FILE).exists()
    assert CONFIG_KEY not in json.loads((copy / "config.json").read_text())
    assert mtplx.load_model(copy).mtp is None


def test_draft_logits_are_the_targets_rows_and_a_floor_elsewhere(reduced):
    m, _, _ = reduced
    ids = np.array(m.draft_vocab.ids)
    g = mx.random.normal((3, 1, 64), key=mx.random.key(3))
    full, draft = np.array(m.logits(g)), np.array(m.draft_logits(g))
    assert draft.shape == full.shape == (3, 1, VOCAB)
    assert np.allclose(draft[..., ids], full[..., ids], atol=1e-5)
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    assert (draft[..., outside] == DRAFT_FLOOR).all()
    assert set(np.argmax(draft, -1).ravel().tolist()) <= set(ids.tolist())
    # a sampled draft's q: zero outside the draft vocabulary; a row allowed only tokens outside
    # it (a grammar) still has a distribution: uniform over what it allows
    from mtplx.sampling import distribution

    q = distribution(draft[0, 0], SamplerConfig(temperature=0.6))
    assert q[outside].sum() == 0.0 and abs(q.sum() - 1) < 1e-6
    masked = np.where(np.isin(np.arange(VOCAB), outside[:5]), draft[0, 0], -np.inf)
    q = distribution(masked, SamplerConfig(temperature=0.6))
    assert np.allclose(q[outside[:5]], 0.2)


@pytest.mark.parametrize("tied,quantized", [(True, False), (False, True), (True, True)])
def test_a_draft_vocabulary_shares_any_output_layer(tmp_path, tied, quantized):
    """Tied (the embedding table, as Gemma 3 270M), untied, 4-bit: the draft vocabulary's logits
    are the target's own at its ids."""
    d, _ = _checkpoint(tmp_path, "t", tied=tied, head=False, branch=0.1)
    m = mtplx.load_model(d)
    if quantized:
        nn.quantize(m.target, group_size=32, bits=4)
    ids = list(range(7, VOCAB, 13))
    dv = build_draft_vocab(m.target, m.arch, ids, VOCAB)
    assert isinstance(dv.proj, nn.QuantizedLinear) == quantized
    h = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    assert mx.allclose(dv.reduced_logits(h), m.logits(h)[..., mx.array(ids)], atol=1e-4).item()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_mtp_with_a_reduced_head_matches_mlx_lm(reduced, depth):
    m, oracle, _ = reduced
    accepted = rejected = 0
    for ids in _prompts(4, seed=11, lengths=(1, 9, 300, 40)):
        r = generate_mtpk(m, ids, TOKENS, GREEDY, depth=depth)
        assert r.tokens == oracle.greedy(ids, TOKENS), (depth, len(ids))
        accepted += r.stats["accepted_drafts"]
        rejected += r.stats["rejected_drafts"]
    assert accepted > 0 and rejected > 0


def test_width8_lane_with_a_reduced_head_matches_mlx_lm(reduced):
    m, oracle, _ = reduced
    lanes = [install_a3b_mtp_batch_lane(m, w, depth=3) for w in (3, 8)]
    assert all(ln.selfcheck["ok"] for ln in lanes), [ln.selfcheck for ln in lanes]
    prompts = _prompts(10, seed=21)
    budgets = [TOKENS - 3 * (i % 4) for i in range(10)]
    running = RunningLane(lanes)
    streams = _staggered(running, [_req(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))])
    assert running.counters.peak_rows == 8
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert streams[i].tokens == oracle.greedy(p, n), f"row {i} (prompt {len(p)})"
    assert running.counters.accepted > 0 and running.counters.rejected > 0
    assert not any("eager_since" in ln._graphs for ln in lanes)


def test_constrained_rows_with_a_reduced_head_match_their_ar_decoding(reduced):
    """Grammar rows whose allowed tokens mostly lie outside the draft vocabulary: their drafts
    come from the floor (uniform over what the grammar allows) and are judged as any draft."""
    from test_structured_lane import _oracle

    from mtplx.structured import Constraint, grammar_tokenizer, regex_grammar

    m, oracle, _ = reduced
    llg = grammar_tokenizer(m.tokenizer, m.vocab_size)
    eos = frozenset(m.eos_token_ids)
    c = Constraint(regex_grammar(r"(yes|no) because [a-z ]{1,20}\."), "regex")
    prompts = _prompts(3, seed=51, lengths=(12, 30, 5))
    reqs = [_req(0, prompts[0], 48, constraint=c, stop_token_ids=eos),
            A3BMTPBatchRequest(request_id="1", prompt_ids=prompts[1], sampler=SamplerConfig(temperature=0.8),
                               max_tokens=48, constraint=c, stop_token_ids=eos, seed=3),
            _req(2, prompts[2], 30)]
    lane = install_a3b_mtp_batch_lane(m, 8, depth=2, selfcheck=False)
    mtp = _staggered(RunningLane(lane), reqs, every=2)
    assert mtp[0].tokens == _oracle(m, llg, prompts[0], c.grammar, 48)
    text = m.tokenizer.decode([t for t in mtp[1].tokens if t not in eos])
    import re

    assert mtp[1].finish_reason == "stop" and re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", text), text
    assert mtp[2].tokens == oracle.greedy(prompts[2], 30)


def test_seeded_sampled_rows_reproduce_and_are_each_as_if_alone(reduced):
    m, _, _ = reduced
    settings = [SamplerConfig(temperature=0.8), GREEDY, SamplerConfig(temperature=1.0, top_p=0.9),
                SamplerConfig(temperature=0.6, top_k=20)]
    streams, alone = _seeded_rows_each_as_if_alone(m, settings)
    again = generate_mtpk(m, _prompts(4, seed=61)[0], 30, settings[0], depth=2, seed=10)
    assert again.tokens == alone[0].tokens
    assert sum(s.rejected_drafts for s in streams) > 0


@pytest.fixture(scope="module")
def split_vocab(reduced, tmp_path_factory):
    """The checkpoint again with a draft vocabulary chosen to leave out half of the tokens the
    target may write second after the test prompt (top_k 3), keeping the other half: so a row's
    second token comes through accepted drafts and through the residual alone."""
    from mtplx.sampling import row_distribution

    m, _, d = reduced
    ids = [5, 6, 7, 8]
    cfg = SamplerConfig(temperature=1.0, top_k=3, top_p=1.0)

    def dist(seq):
        return row_distribution(m.logits(m.hidden(mx.array([ids + seq]), m.make_cache()))[0, -1], cfg)

    joint = {}
    p1 = dist([])
    for t1, a in zip(p1.ids.tolist(), p1.probs):
        p2 = dist([t1])
        joint.update({(t1, t2): a * b for t2, b in zip(p2.ids.tolist(), p2.probs)})
    seconds = sorted({t2 for _, t2 in joint})
    keep = set(seconds[::2])
    rng = np.random.default_rng(4)
    others = [t for t in rng.permutation(VOCAB).tolist() if t not in seconds][:K - len(keep)]
    copy = d.parent / "split-vocab"
    shutil.copytree(d, copy)
    save_head(copy, _agree_head(m.target.args), sorted(keep | set(others)), {"trained_by": "the test"})
    return mtplx.load_model(copy), ids, cfg, joint, keep


@pytest.mark.parametrize("draw", ["host", "device"])
def test_sampled_rows_keep_the_target_joint_distribution_with_a_reduced_head(split_vocab, draw):
    """(t1, t2) of seeded rows in a running B8 lane (t2 through a draft from q, zero outside the
    draft vocabulary, the accept test and the residual) follows the target's exact joint; drafts
    drawn on the host from the whole q, or on the device. Chi-square at a false-alarm rate of
    1e-4, fixed seeds. Power: were every draft accepted, t2 would follow q, which cannot reach the
    tokens outside the vocabulary at all."""
    from test_lane import seeded_outcomes
    from test_sampling import ALPHA, chi2_test

    from mtplx.sampling import row_distribution

    m, ids, cfg, joint, keep = split_vocab
    assert 4 <= len(joint) <= 9
    assert {t2 for _, t2 in joint} - keep and {t2 for _, t2 in joint} & keep
    running = RunningLane(install_a3b_mtp_batch_lane(m, 8, selfcheck=False), settings=EngineSettings(draft_draw=draw))
    n = 1200
    streams, counts = seeded_outcomes(running, ids, n, 2, cfg, cfg)
    assert running.counters.peak_rows == 8
    assert sum(s.accepted_drafts for s in streams) > 100 and sum(s.rejected_drafts for s in streams) > 100
    assert (running.stats().device_drafts > 100) == (draw == "device")
    p_value, df = chi2_test(counts, joint)
    assert df >= 3 and p_value > ALPHA, (p_value, df, counts)
    # power: under "accept every draft", t2 ~ q given t1
    bad = {}
    for t1 in {t for t, _ in joint}:
        g = m.draft_hidden(m.hidden(mx.array([ids]), m.make_cache())[:, -1:], mx.array([[t1]]), m.make_mtp_cache())
        q = row_distribution(m.draft_logits(g)[0, -1], cfg, {t1: 1})
        p1 = sum(v for k, v in joint.items() if k[0] == t1)
        bad.update({(t1, t2): p1 * b for t2, b in zip(q.ids.tolist(), q.probs)})
    lam = n * sum((bad.get(k, 0.0) - v) ** 2 / v for k, v in joint.items())
    assert lam > 100, lam
