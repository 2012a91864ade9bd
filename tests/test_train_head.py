"""`mtplx train-head` end to end on a small random `gemma3_text` without a head (Gemma 3 270M's
layout, tied embedding): it writes a head and its config entry beside the checkpoint, leaves the
target's weights and greedy output as they were, and a run killed in the middle continues when
started again, to the same head as a run never stopped. Its pieces: the target's own text (left
padded batches, token for token what the target writes alone), the chained loss's gradient (the
head's alone), the draft vocabulary's choice."""

import hashlib
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_gemma3 import VOCAB, _checkpoint, _prompts

import mtplx
from mtplx.cli import main as cli
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.models.draft_head import CONFIG_KEY, HEAD_FILE
from mtplx.sampling import GREEDY
from mtplx.training import train_head

SMALL = ["--prompts", "24", "--heldout", "4", "--new-tokens", "12", "--gen-batch", "8", "--steps", "3", "4",
         "--batch", "4", "--draft-vocab", "512"]


def _digest(d) -> str:
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_head")
    d, _ = _checkpoint(root, "plain", tied=True, head=False, branch=0.1)
    return d


@pytest.fixture(scope="module")
def trained(plain, tmp_path_factory):
    """A copy of `plain` with the head of a train-head run never stopped."""
    import shutil

    d = tmp_path_factory.mktemp("trained") / "b"
    shutil.copytree(plain, d)
    cli(["train-head", str(d), *SMALL])
    return d


def _head_tensors(d) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(d / HEAD_FILE)).items()}


def test_train_head_writes_a_head_beside_the_checkpoint_and_resumes_after_a_kill(plain, trained, tmp_path,
                                                                                   monkeypatch):
    import shutil

    before, prompts = _digest(plain), _prompts(3, seed=5, lengths=(4, 30, 9))
    m0 = mtplx.load_model(plain)
    assert m0.mtp is None
    ar_before = [generate_ar(m0, p, 24, GREEDY).tokens for p in prompts]
    a = tmp_path / "a"
    shutil.copytree(plain, a)
    monkeypatch.setattr(train_head, "CHECKPOINT_EVERY_S", 0.0)       # a checkpoint every step

    # a: killed at phase 2's third step, then started again
    batch, killed = train_head.Windows.batch, []

    def dies_once(self, seed, step, size):
        if seed % 1000 == 2 and step == 2 and not killed:
            killed.append(step)
            raise KeyboardInterrupt
        return batch(self, seed, step, size)

    monkeypatch.setattr(train_head.Windows, "batch", dies_once)
    with pytest.raises(KeyboardInterrupt):
        cli(["train-head", str(a), *SMALL])
    assert killed and not (a / HEAD_FILE).exists()
    assert json.loads((a.with_name("a.train-head") / "phase2.json").read_text())["step"] == 2
    cli(["train-head", str(a), *SMALL])
    ta, tb = _head_tensors(a), _head_tensors(trained)          # the same head as a run never stopped
    assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)

    entry = json.loads((a / "config.json").read_text())[CONFIG_KEY]
    assert entry["draft_vocab_size"] == 512 and entry["trained_by"] == "mtplx train-head"
    assert set(entry["heldout_acceptance"]) == {"greedy", "t0.6"}
    assert all(len(v) == 3 and all(0 <= x <= 1 for x in v) for v in entry["heldout_acceptance"].values())
    assert entry["greedy_check"]["identical"]
    assert _digest(a) == before                       # the target's weights untouched
    m = mtplx.load_model(a)
    assert m.mtp is not None and m.draft_vocab.size == 512
    for p, ref in zip(prompts, ar_before):
        assert generate_ar(m, p, 24, GREEDY).tokens == ref           # the target's greedy output unchanged
        assert generate_mtpk(m, p, 24, GREEDY, depth=3).tokens == ref
    with pytest.raises(SystemExit, match="already has a head"):
        cli(["train-head", str(a), *SMALL])


def test_own_text_in_padded_batches_is_what_the_target_writes_alone(plain):
    from mtplx.training.distill import continue_text, mlx_lm_classes
    from mtplx.training.own_text import write_batch

    m = mtplx.load_model(plain)
    mlx_lm_classes(m.target)
    prompts = _prompts(3, seed=8, lengths=(3, 17, 9))
    shard = write_batch(m, prompts, 10, np.zeros(3), seed=0, stop_ids=frozenset())
    assert not np.isnan(shard.hidden.astype(np.float32)).any()
    for b, p in enumerate(prompts):
        ref = continue_text(m, mx.array([p]), 10, 0.0)[0]
        row = shard.tokens[b, shard.start[b]:]
        assert row.tolist() == ref.tolist()
        h = m.hidden(mx.array([ref.tolist()]))
        assert np.allclose(shard.hidden[b, shard.start[b]:].astype(np.float32), np.array(h[0]), atol=2e-2, rtol=2e-3)
        lse = np.array(mx.logsumexp(m.logits(h[0]), axis=-1))
        P = shard.prompt_end
        assert np.allclose(shard.lse[b, P - 1:P + 9], lse[len(p) - 1:len(p) + 9], atol=1e-4)


def test_own_text_rows_take_the_argmax_or_a_draw_at_their_temperature_and_the_exact_logsumexp():
    """The host-side step of writing the target's text: greedy rows the argmax, sampled rows
    distributed as softmax(logits / T) (chi-square at the suite's false-alarm rate), the same
    draws for a seed, and the logsumexp of the whole row."""
    from test_sampling import ALPHA, chi2_test

    from mtplx.training.own_text import _lse_and_draw

    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05, 1e-9]] * 3, dtype=np.float32)) + 3.0
    temperatures = np.array([0.0, 0.6, 1.0])
    sampled = np.flatnonzero(temperatures > 0)
    lse, _ = _lse_and_draw(logits, temperatures, sampled, np.random.default_rng(0))
    want = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    assert np.allclose(lse, want, atol=1e-6) and lse.dtype == np.float32
    rng = np.random.default_rng(5)
    draws = np.array([_lse_and_draw(logits, temperatures, sampled, rng)[1] for _ in range(4000)])
    assert (draws[:, 0] == 0).all()
    for b in sampled:
        probs = np.exp(logits[b].astype(np.float64) / temperatures[b])
        probs /= probs.sum()
        counts = dict(zip(*np.unique(draws[:, b], return_counts=True)))
        p_value, df = chi2_test({int(k): int(v) for k, v in counts.items()}, dict(enumerate(probs)))
        assert p_value > ALPHA, (b, p_value, df, counts)
    assert (_lse_and_draw(logits, temperatures, sampled, np.random.default_rng(5))[1] == draws[0]).all()


def test_the_chain_loss_trains_the_head_alone_and_equals_the_heads_chain(plain):
    """One gradient of the chained loss: finite, on every head parameter; the chained forward is
    the head run as drafting runs it, through its cache (the gemma3 block included)."""
    from mlx_lm.models.cache import KVCache

    from mtplx.models.draft_head import build_draft_vocab
    from mtplx.models.mtp_chain import chained_drafts
    from mtplx.training.distill import mlx_lm_classes

    m = mtplx.load_model(plain)
    mlx_lm_classes(m.target)
    head = train_head.new_head(m)
    x = mx.array(np.random.default_rng(0).integers(3, VOCAB, size=(2, 30)).astype(np.int32))
    h = m.hidden(x)
    emb = m.embed(x[:, 1:])
    outs = chained_drafts(head, h[:, :26], emb, 3)
    for p in (0, 11, 25):
        cache = [KVCache() for _ in head.layers]
        g = head(h[:, :p + 1], emb[:, :p + 1], cache)[:, -1:]
        assert mx.abs(g[:, 0] - outs[0][:, p]).max().item() < 1e-4
        for k in (1, 2):
            g = head(g, emb[:, p + k:p + k + 1], cache)
            assert mx.abs(g[:, 0] - outs[k][:, p]).max().item() < 1e-4, (p, k)
    dv = build_draft_vocab(m.target, m.arch, list(range(0, VOCAB, 8)), VOCAB)
    lse = mx.logsumexp(m.logits(h), axis=-1)
    valid = mx.ones(x.shape)
    loss_fn = train_head.chain_loss(dv.reduced_logits, m.embed, 3, 8)
    (loss, _), grads = nn.value_and_grad(head, loss_fn)(head, (h, x, lse, valid))
    assert np.isfinite(loss.item())
    flat = [g for _, g in tree_flatten(grads)]
    assert len(flat) == len(tree_flatten(head.trainable_parameters()))
    assert all(bool(mx.all(mx.isfinite(g)).item()) for g in flat) and any(mx.abs(g).max().item() > 0 for g in flat)


def test_the_draft_vocabulary_is_the_most_written_tokens_and_auto_measures(plain):
    written = np.array([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])
    order = train_head.frequency_order(written, 16)
    assert order[:4].tolist() == [7, 5, 9, 2]
    assert train_head.coverage(order, written, 2) == 0.7
    m = mtplx.load_model(plain)
    k, facts = train_head.choose_draft_vocab(m, train_head.frequency_order(np.arange(VOCAB), VOCAB),
                                             np.arange(VOCAB), 3, "auto")
    assert k is None or k < VOCAB
    assert set(facts["candidates"]) == {VOCAB} and facts["candidates"][VOCAB]["coverage_heldout"] == 1.0


def test_a_shipped_head_installs_beside_a_checkpoint_once(plain, trained, tmp_path, monkeypatch):
    """A trained head made a package asset (float16, its entry, the model's NOTICE and terms) is
    what `mtplx models add` puts beside each variant it installs: the file, its config entry (with
    the file's SHA256) and a NOTICE line; again, nothing changes; it runs in the target's dtype; a
    head trained on another model is refused."""
    import shutil

    from mtplx.models import draft_head
    from mtplx.models.errors import CheckpointShapeError

    (trained / "NOTICE").write_text("Gemma notice. Beside this file: GEMMA_TERMS.html.\n")
    (trained / "GEMMA_TERMS.html").write_text("<p>the terms</p>")
    assets = tmp_path / "assets"
    out = draft_head.write_asset(trained, "tiny-mtp", "mtp_head.safetensors: a head trained here.", assets)
    assert (out / "NOTICE").read_text() == (
        "Gemma notice. Beside this file: GEMMA_TERMS.html.\nmtp_head.safetensors: a head trained here.\n")
    assert (out / "GEMMA_TERMS.html").is_file() and not (out / "model.safetensors").exists()
    half = mx.load(str(out / HEAD_FILE))
    assert half["mtp.fc.weight"].dtype == mx.float16 and half["draft_ids"].dtype == mx.int32
    # retrained beside a checkpoint whose NOTICE names the head it had: the same asset, float16
    (trained / "NOTICE").write_text("Gemma notice. Beside this file: GEMMA_TERMS.html.\n"
                                    "mtp_head.safetensors: a head trained here.\n")
    again = draft_head.write_asset(trained, "tiny-mtp", "mtp_head.safetensors: a head trained here.", tmp_path / "again")
    assert (again / "NOTICE").read_text() == (out / "NOTICE").read_text()
    assert mx.load(str(again / HEAD_FILE))["mtp.fc.weight"].dtype == mx.float16
    entry = json.loads((out / draft_head.ASSET_ENTRY).read_text())
    monkeypatch.setattr(draft_head, "ASSETS", assets)
    d = tmp_path / "installed"
    shutil.copytree(plain, d)
    (d / "NOTICE").write_text("The model's notice.\n")
    before = _digest(d)
    assert draft_head.install_shipped_head(d, "tiny-mtp", say=lambda s: None)
    assert not draft_head.install_shipped_head(d, "tiny-mtp", say=lambda s: None)
    got = json.loads((d / "config.json").read_text())[CONFIG_KEY]
    assert got["installed_from"] == "tiny-mtp" and got["draft_vocab_size"] == 512
    assert got["sha256"] == hashlib.sha256((d / HEAD_FILE).read_bytes()).hexdigest()
    assert (d / "NOTICE").read_text().count("a head trained here") == 1 and _digest(d) == before
    m = mtplx.load_model(d)
    assert m.mtp.fc.weight.dtype == mx.float32
    p = _prompts(1, seed=3, lengths=(12,))[0]
    assert generate_mtpk(m, p, 16, GREEDY, depth=2).tokens == generate_ar(m, p, 16, GREEDY).tokens
    (d / "mtplx_model.json").write_text(json.dumps({"source_sha256": "another"}))
    entry["trained_on"]["source_sha256"] = "this one"
    (assets / "tiny-mtp" / draft_head.ASSET_ENTRY).write_text(json.dumps(entry))
    with pytest.raises(CheckpointShapeError, match="another model"):
        draft_head.install_shipped_head(d, "tiny-mtp", say=lambda s: None)
