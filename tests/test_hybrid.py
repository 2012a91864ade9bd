"""Qwen3.5/3.6 (dense and MoE) and Qwen3-Next: hybrid GDN + attention targets with their MTP heads,
capture-commit rollback of GDN state, solo and in cohorts (CPU, fp32, tiny random-weight models).

Random weights accept almost no draft, which would leave rejection-free paths untested. So the
tiny checkpoints are built to be predictable: every residual branch's output projection (attention
`o_proj`, GDN `out_proj`, MLP/expert `down_proj`) is scaled by 0.1, which makes the target nearly a
bigram model (logits ~ lm_head(norm(embed(token)))), and the MTP head's `fc` passes the embedding
half through (identity on the embedding, zero on the hidden), with its own decoder block scaled the
same way. The head then predicts the target's next-next token most of the time but not always:
~65% of drafts are accepted, so every run mixes acceptances and rejections at different cycles in
different rows. Exactness never depends on the drafts: greedy MTP must equal greedy AR whatever
the head predicts.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

import mtplx
from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import LaneSelfCheckError, install_a3b_mtp_batch_lane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.decode import generate_mtpk
from mtplx.models import recurrent_cache as rc
from mtplx.models.errors import CheckpointShapeError
from mtplx.models.loader import SHIPPED_MODEL, _architectures
from mtplx.models.mtp_head import MTPHead
from mtplx.models.recurrent_cache import RecurrentCache
from mtplx.sampling import GREEDY
from mtplx.scheduler.session_bank import SessionBank

from references import greedy_ar

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
VOCAB = 4096                        # the shipped tokenizer's
COMMON = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              vocab_size=VOCAB, max_position_embeddings=1024, full_attention_interval=2,
              tie_word_embeddings=False, mtp_num_hidden_layers=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
           moe_intermediate_size=32, norm_topk_prob=True)
BRANCH_OUT = ("o_proj", "out_proj", "down_proj")
HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
            ".q_norm.weight", ".k_norm.weight")
MTP_HEAD_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def _config(kind):
    if kind == "qwen3_next":
        return dict(COMMON, **MOE, model_type="qwen3_next", mlp_only_layers=[], rope_theta=10000.0,
                    partial_rotary_factor=0.25, eos_token_id=[0, 2])
    text = dict(COMMON, model_type=kind + "_text",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if kind == "qwen3_5_moe":
        text.update(MOE)
    # HF nests the language model's config under text_config (the checkpoints are multimodal)
    return {"model_type": kind, "text_config": text, "tie_word_embeddings": False, "eos_token_id": [0, 2]}


def _write(dst: Path, cfg: dict, weights: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / f, dst / f)
    return dst


def _build_weights(kind, seed=0, scale=0.1) -> dict:
    """mlx-layout weights of a tiny predictable target plus its MTP head (see the module doc)."""
    mx.random.seed(seed)
    cfg = _config(kind)
    model_cls, args_cls = _get_classes(cfg)
    target = model_cls(args_cls.from_dict(cfg))
    arch = _architectures()[kind]
    head = MTPHead(arch.hidden_size(target.args), arch.rms_norm_eps(target.args),
                   lambda: arch.make_mtp_block(target.args))
    for mod in (target, head):
        small = [(k, v * scale) for k, v in tree_flatten(mod.parameters()) if k.split(".")[-2] in BRANCH_OUT]
        mod.update(tree_unflatten(small))
    H = COMMON["hidden_size"]
    head.fc.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    weights = dict(tree_flatten(target.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    mx.eval(weights)
    return weights


def _to_hf(kind, weights: dict) -> dict:
    """The same weights in the published HF layout: conv1d [C, 1, K], zero-centred norms, experts
    fused (Qwen3.5 MoE) or one tensor per expert (Qwen3-Next), `model.language_model.*` names."""
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        if k.endswith(HF_NORMS) or k in MTP_HEAD_NORMS:
            v = v - 1.0
        if ".switch_mlp." in k:
            prefix, proj = k.split(".switch_mlp.")
            proj = proj.split(".")[0]
            if kind == "qwen3_next":
                for e in range(v.shape[0]):
                    out[f"{prefix}.experts.{e}.{proj}.weight"] = v[e]
                continue
            if proj == "gate_proj":
                up = weights[f"{prefix}.switch_mlp.up_proj.weight"]
                out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            elif proj == "down_proj":
                out[f"{prefix}.experts.down_proj"] = v
            continue
        out[k] = v
    if kind != "qwen3_next":
        out = {k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
               : v for k, v in out.items()}
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {kind: _write(root / kind, _config(kind), _build_weights(kind)) for kind in ARCHS}


@pytest.fixture(scope="module")
def models(paths):
    return {kind: mtplx.load_model(p) for kind, p in paths.items()}


@pytest.fixture(scope="module")
def lanes(models):
    return {(kind, w): install_a3b_mtp_batch_lane(m, w) for kind, m in models.items() for w in (3, 8)}


def _prompts(n, seed=1, lengths=(1, 5, 300, 40, 2, 17, 64, 9)):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


def _req(i, ids, n, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=ids, sampler=GREEDY, max_tokens=n, **kw)


def _row_view(s):
    return (s.tokens, s.finish_reason, s.accepted_drafts, s.rejected_drafts, s.cycles)


# ------------------------------------------------------------------ loading

@pytest.mark.parametrize("kind", ARCHS)
def test_loads_with_mtp_head_and_recurrent_caches(models, kind):
    m = models[kind]
    assert m.mtp is not None and m.vocab_size == VOCAB and m.max_context == 1024
    layers = m.arch.text_model(m.target).layers
    cache = m.make_cache()
    assert [type(c) for c in cache] == [RecurrentCache if l.is_linear else KVCache for l in layers]
    assert all(getattr(type(l.linear_attn), "_mtplx_capture", False) for l in layers if l.is_linear)
    block = m.mtp.layers[0]
    assert not block.is_linear and hasattr(block, "self_attn")
    assert hasattr(block.mlp, "switch_mlp") == (kind != "qwen3_5")     # MoE head where the target is MoE


@pytest.mark.parametrize("kind", ARCHS)
def test_hf_layout_loads_to_the_same_model(paths, models, kind, tmp_path):
    weights = dict(mx.load(str(paths[kind] / "model.safetensors")))
    hf = _write(tmp_path / "hf", _config(kind), _to_hf(kind, weights))
    m = mtplx.load_model(hf)
    ids = _prompts(1, seed=7, lengths=(30,))[0]
    ref = models[kind]
    h1, h2 = ref.hidden(mx.array([ids]), ref.make_cache()), m.hidden(mx.array([ids]), m.make_cache())
    assert np.allclose(np.array(h1), np.array(h2), atol=1e-5)
    mc1, mc2 = ref.make_mtp_cache(), m.make_mtp_cache()
    g1 = ref.draft_hidden(h1, mx.array([ids[1:] + [5]]), mc1)
    g2 = m.draft_hidden(h2, mx.array([ids[1:] + [5]]), mc2)
    assert np.allclose(np.array(g1), np.array(g2), atol=1e-5)
    assert generate_mtpk(m, ids, 24, GREEDY).tokens == greedy_ar(ref, ids, 24)


def test_quantized_mtp_head_loads_with_mixed_widths(paths, tmp_path):
    """An mlx-lm-style quantized head (4-bit group 32, `mtplx_mtp_quantization`; its routers 8-bit)
    loads with each layer's width read off its stored shapes, and decodes exactly."""
    kind = "qwen3_5_moe"
    m = mtplx.load_model(paths[kind])
    nn.quantize(m.mtp, class_predicate=lambda p, mod: isinstance(mod, (nn.Linear, type(m.mtp.layers[0].mlp.switch_mlp.up_proj)))
                and ({"group_size": 32, "bits": 8} if p.endswith(("mlp.gate", "shared_expert_gate")) else
                     {"group_size": 32, "bits": 4}))
    weights = {k: v for k, v in mx.load(str(paths[kind] / "model.safetensors")).items() if not k.startswith("mtp.")}
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(m.mtp.parameters())})
    cfg = dict(_config(kind), mtplx_mtp_quantization={"group_size": 32, "bits": 4, "mode": "affine"})
    q = mtplx.load_model(_write(tmp_path / "q", cfg, weights))
    assert isinstance(q.mtp.fc, nn.QuantizedLinear) and q.mtp.fc.bits == 4 and q.mtp.fc.group_size == 32
    assert q.mtp.layers[0].mlp.gate.bits == 8
    assert q.mtp.layers[0].mlp.switch_mlp.up_proj.bits == 4
    for ids in _prompts(3, seed=4):
        r = generate_mtpk(q, ids, 32, GREEDY)
        assert r.tokens == greedy_ar(q, ids, 32)
    assert r.stats["accepted_drafts"] > 0


def test_malformed_checkpoints_raise_clear_errors(paths, tmp_path):
    nxt = dict(mx.load(str(paths["qwen3_next"] / "model.safetensors")))
    hf = _to_hf("qwen3_next", nxt)
    cfg = _config("qwen3_next")
    broken = {k: v for k, v in hf.items() if k != "mtp.layers.0.mlp.experts.3.up_proj.weight"}
    with pytest.raises(CheckpointShapeError, match="experts"):
        mtplx.load_model(_write(tmp_path / "a", cfg, broken))
    moe = _to_hf("qwen3_5_moe", dict(mx.load(str(paths["qwen3_5_moe"] / "model.safetensors"))))
    broken = {k: v for k, v in moe.items() if k != "mtp.layers.0.mlp.experts.down_proj"}
    with pytest.raises(CheckpointShapeError, match="down_proj"):
        mtplx.load_model(_write(tmp_path / "b", _config("qwen3_5_moe"), broken))
    dense = dict(mx.load(str(paths["qwen3_5"] / "model.safetensors")))
    with pytest.raises(CheckpointShapeError, match="MTP head"):
        mtplx.load_model(_write(tmp_path / "c", _config("qwen3_5"), dict(dense, **{"mtp.fc.weight": mx.zeros((32, 48))})))
    with pytest.raises(CheckpointShapeError, match="MTP head"):
        mtplx.load_model(_write(tmp_path / "d", _config("qwen3_5"),
                                {k: v for k, v in dense.items() if k != "mtp.norm.weight"}))
    gdn = "language_model.model.layers.0.linear_attn.in_proj_qkv.weight"
    with pytest.raises(CheckpointShapeError, match="target weights"):
        mtplx.load_model(_write(tmp_path / "e", _config("qwen3_5"), dict(dense, **{gdn: dense[gdn][:, :16]})))


# ------------------------------------------------------------------ capture-commit at layer level

def _gdn(models, kind="qwen3_5_moe"):
    m = models[kind]
    return next(l.linear_attn for l in m.arch.text_model(m.target).layers if l.is_linear)


@pytest.mark.parametrize("kind", ARCHS)
def test_capture_forward_is_bitwise_the_mlx_lm_forward(models, kind):
    layer = _gdn(models, kind)
    plain = type(layer).__mro__[1].__call__          # mlx-lm's own GDN forward
    mx.random.seed(3)
    x, v = mx.random.normal((3, 7, 32)), mx.random.normal((3, 3, 32))
    a, b = RecurrentCache(), RecurrentCache()
    layer(x, None, a)                                  # 7 > CAPTURE_MAX_T: mlx-lm's fast path
    plain(layer, x, None, b)
    assert a.captured_positions == 0
    out_a, out_b = layer(v, None, a), plain(layer, v, None, b)
    assert a.captured_positions == 3
    assert mx.array_equal(out_a, out_b).item()
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


def test_commit_keeps_0_1_2_per_row_like_a_replay(models):
    """Batched capture-commit leaves each row exactly where a solo replay of its kept positions
    would: keep 0 is bit-for-bit the pre-verify state; no row sees another's keep."""
    layer = _gdn(models)
    mx.random.seed(5)
    x, v = mx.random.normal((3, 6, 32)), mx.random.normal((3, 2, 32))
    c = RecurrentCache()
    layer(x, None, c)
    pre = (c[0], c[1])
    layer(v, None, c)
    c.advance(np.array([0, 1, 2]) - 2)                # commit_rows(written=2, keep=[0, 1, 2])
    assert mx.array_equal(c[0][0], pre[0][0]).item() and mx.array_equal(c[1][0], pre[1][0]).item()
    for b, keep in enumerate((0, 1, 2)):
        solo = RecurrentCache()
        layer(x[b:b + 1], None, solo)
        for t in range(keep):
            layer(v[b:b + 1, t:t + 1], None, solo)
        assert np.allclose(np.array(c[0][b]), np.array(solo[0][0]), atol=1e-6)
        assert np.allclose(np.array(c[1][b]), np.array(solo[1][0]), atol=1e-6)
    # solo trim: drop 2 of 3 captured positions -> the state after the first
    s, r = RecurrentCache(), RecurrentCache()
    layer(x[:1], None, s)
    layer(x[:1], None, r)
    layer(v[:1, :1], None, r)
    layer(mx.concatenate([v[:1], v[:1, :1]], axis=1), None, s)
    assert s.trim(2) == 2 and s.captured_positions == 0
    assert mx.array_equal(s[1], r[1]).item() and mx.array_equal(s[0], r[0]).item()


def test_commit_of_all_layers_at_once_equals_each_layer_alone(models):
    """A cohort commits its GDN layers in one compiled select: bit-for-bit each layer's own."""
    layer = _gdn(models)
    mx.random.seed(6)
    caches = []
    for _ in range(3):
        x, v = mx.random.normal((4, 5, 32)), mx.random.normal((4, 2, 32))
        one, alone = RecurrentCache(), RecurrentCache()
        for c in (one, alone):
            layer(x, None, c)
            layer(v, None, c)
        caches.append((one, alone))
    delta = np.array([0, 1, 2, 1]) - 2
    RecurrentCache.advance_all([one for one, _ in caches], delta)
    for one, alone in caches:
        alone.advance(delta)
        assert one.captured_positions == 0
        assert mx.array_equal(one[0], alone[0]).item() and mx.array_equal(one[1], alone[1]).item()


def test_rollback_without_capture_is_an_error(models):
    layer = _gdn(models)
    c = RecurrentCache()
    layer(mx.zeros((1, 9, 32)), None, c)              # a prefill chunk: nothing captured
    with pytest.raises(RuntimeError, match="cannot be rolled back"):
        c.trim(1)
    c.trim(0)                                          # keeping everything needs no capture
    lane = RecurrentCache.empty_rows(2)
    for b in range(2):
        lane.put_row(b, c)
    assert lane[1].shape[0] == 2 and lane.make_mask(2) is None


# ------------------------------------------------------------------ solo

@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_solo_mtp_equals_ar(models, kind, depth):
    m = models[kind]
    acc = rej = 0
    for ids in _prompts(4, seed=depth):
        r = generate_mtpk(m, ids, 40, GREEDY, depth=depth)
        assert r.tokens == greedy_ar(m, ids, 40)
        acc += r.stats["accepted_drafts"]
        rej += r.stats["rejected_drafts"]
    assert acc > 0 and rej > 0


def test_depth3_solo_exact(models):
    m = models["qwen3_next"]
    for ids in _prompts(2, seed=9):
        assert generate_mtpk(m, ids, 40, GREEDY, depth=3).tokens == greedy_ar(m, ids, 40)


@pytest.mark.parametrize("kind", ARCHS)
def test_broken_rollback_is_caught(models, monkeypatch, kind):
    """The parity checks have teeth: a GDN commit that forgets to roll back diverges from AR, and
    the lane's self-check refuses to install. (These near-bigram models make GDN state matter
    little, so the self-check's short rows catch it at width 8, not always at width 3.)"""
    m = models[kind]
    monkeypatch.setattr(rc.RecurrentCache, "rollback", lambda self, kept: self.clear_capture())
    monkeypatch.setattr(rc.RecurrentCache, "advance_all",
                        classmethod(lambda cls, caches, delta: [c.clear_capture() for c in caches]))
    diverged = [generate_mtpk(m, ids, 40, GREEDY).tokens != greedy_ar(m, ids, 40)
                for ids in _prompts(3, seed=2, lengths=(40, 5, 17))]
    assert any(diverged)
    with pytest.raises(LaneSelfCheckError):
        install_a3b_mtp_batch_lane(m, 8)


def test_prefix_reuse_restores_recurrent_state(models):
    m = models["qwen3_5_moe"]
    bank = SessionBank("hybrid")
    base = _prompts(1, seed=11, lengths=(300,))[0]
    p1, p2 = base + [7, 8], base + [9, 10, 11]
    generate_mtpk(m, p1, 8, GREEDY, session_restore=lambda: bank.lookup(p1), session_commit=bank.commit)
    warm = generate_mtpk(m, p2, 32, GREEDY, session_restore=lambda: bank.lookup(p2), session_commit=bank.commit)
    assert warm.stats["cached_tokens"] == 256
    assert warm.tokens == greedy_ar(m, p2, 32)
    # the same prompt again: its whole prefill's state (KV, conv window, recurrent state) comes back
    again = generate_mtpk(m, p2, 32, GREEDY, session_restore=lambda: bank.lookup(p2), session_commit=bank.commit)
    assert again.stats["cached_tokens"] == len(p2)
    assert again.tokens == greedy_ar(m, p2, 32)


# ------------------------------------------------------------------ cohorts

@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("width", [3, 8])
def test_every_cohort_row_equals_solo_ar(models, lanes, kind, width):
    m, lane = models[kind], lanes[(kind, width)]
    assert lane.selfcheck["ok"] and set(lane.selfcheck["commit_keeps_seen"]) >= {0, 2}
    prompts = _prompts(width, seed=width)            # lengths 1..300 in one cohort
    budgets = [24 + 7 * i for i in range(width)]
    res = generate_a3b_mtp_batch(lane, [_req(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))])
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert res.streams[i].tokens == greedy_ar(m, p, n), f"{kind} B{width} row {i}"
    assert res.accepted_drafts > 0 and res.rejected_drafts > 0
    assert len({s.rejected_drafts for s in res.streams}) > 1     # rows reject at different cycles


@pytest.mark.parametrize("kind", ARCHS)
def test_row_isolation_with_recurrent_state(models, lanes, kind):
    """A row that rejects differently, finishes early or is cancelled leaves every neighbour's
    tokens and counters exactly as in an undisturbed run."""
    m, lane = models[kind], lanes[(kind, 8)]
    prompts = _prompts(6, seed=21)
    base = generate_a3b_mtp_batch(lane, [_req(i, p, 48) for i, p in enumerate(prompts)])
    seen = []
    reqs = [_req(i, p, 48) for i, p in enumerate(prompts)]
    reqs[0] = _req(0, _prompts(1, seed=99, lengths=(23,))[0], 48)             # other drafts, rejects
    reqs[1] = _req(1, prompts[1], 48, stop_token_ids={base.streams[1].tokens[5]})   # finishes early
    reqs[2] = _req(2, prompts[2], 48, on_token=seen.append, cancelled=lambda: len(seen) >= 7)
    reqs[3] = _req(3, prompts[3], 3)                                           # tiny budget
    res = generate_a3b_mtp_batch(lane, reqs)
    assert res.streams[0].tokens == greedy_ar(m, reqs[0].prompt_ids, 48)
    assert res.streams[1].finish_reason == "stop" and len(res.streams[1].tokens) <= 6
    assert res.streams[2].finish_reason == "cancelled"
    assert res.streams[2].tokens == base.streams[2].tokens[:len(res.streams[2].tokens)]
    assert res.streams[3].tokens == base.streams[3].tokens[:3]
    for i in (4, 5):
        assert _row_view(res.streams[i]) == _row_view(base.streams[i]), f"{kind} row {i} was disturbed"


@pytest.mark.parametrize("kind", ARCHS)
def test_running_lane_admits_widens_and_narrows_with_recurrent_state(models, lanes, kind):
    """GDN rows joining a running lane mid-flight (their state put into a free row), the lane
    widening B3 -> B8 and narrowing back (states carried over by row): every row stays exact."""
    from mtplx.engine.lane import RunningLane

    m = models[kind]
    running = RunningLane([lanes[(kind, 3)], lanes[(kind, 8)]], narrow_after=3)
    prompts = _prompts(6, seed=41)
    budgets = [60, 20, 24, 30, 26, 22]
    streams = [running.add(_req(i, prompts[i], budgets[i])) for i in range(2)]
    for _ in range(4):
        running.step()
    streams += [running.add(_req(i, prompts[i], budgets[i])) for i in range(2, 6)]
    while running.has_work:
        running.step()
    assert running.counters.widenings == 1 and running.counters.narrowings >= 1 and set(running.counters.width_cycles) >= {3, 8}
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert streams[i].tokens == greedy_ar(m, p, n), f"{kind} row {i}"
        assert (streams[i].admitted_at_cycle == 0) if i < 2 else (streams[i].admitted_at_cycle >= 4)


def test_a_lane_changes_depth_with_its_rows_sampling_with_recurrent_state(models, lanes):
    """Greedy GDN rows chain 2 drafts in a B3 lane; a sampled row that chains 3 joining moves the
    lane to depth 3 at the same width (the rows' recurrent state and owed head history carried
    over), and its leaving moves it back: greedy rows equal plain greedy decoding, the sampled row
    equals itself decoded alone."""
    from mtplx.engine.installed import solo_lane
    from mtplx.engine.lane import RunningLane
    from mtplx.sampling import SamplerConfig

    m = models["qwen3_5"]
    greedy = install_a3b_mtp_batch_lane(m, 3, selfcheck=False, depth=2)
    sampled_lane = install_a3b_mtp_batch_lane(m, 3, selfcheck=False, depth=3)
    prompts = _prompts(3, seed=43)
    hot = A3BMTPBatchRequest(request_id="s", prompt_ids=prompts[2], max_tokens=16, seed=5,
                             sampler=SamplerConfig(temperature=0.8, top_p=0.9, top_k=0))
    alone = RunningLane(solo_lane(m, 3))
    ref = alone.add(hot)
    while alone.has_work:
        alone.step()
    running = RunningLane(lanes[("qwen3_5", 3)], greedy_ladder=greedy, sampled_ladder=sampled_lane)
    streams = [running.add(_req(i, prompts[i], 60)) for i in range(2)]
    for _ in range(4):
        running.step()
    assert running.lane.depth == 2
    sampled = running.add(hot)
    running.step()
    assert running.lane.depth == 3 and running.width == 3
    while sampled.finish_reason is None:
        running.step()
    running.step()
    assert running.lane.depth == 2 and running.counters.depth_switches == 2
    while running.has_work:
        running.step()
    assert sampled.tokens == ref.tokens and sampled.mtp_depth == 3
    for i in range(2):
        assert streams[i].tokens == greedy_ar(m, prompts[i], 60), f"row {i}"


def test_sampled_cohort_row_independent(models, lanes):
    """Sampled rows (each its own RNG) on a hybrid: reproducible, and row 0 does not move when
    every neighbour changes."""
    from mtplx.sampling import SamplerConfig

    cfg = SamplerConfig(temperature=0.8)
    lane = lanes[("qwen3_5_moe", 8)]
    prompts = _prompts(8, seed=31)
    reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=cfg, seed=100 + i, max_tokens=30)
            for i, p in enumerate(prompts)]
    a, b = generate_a3b_mtp_batch(lane, reqs), generate_a3b_mtp_batch(lane, reqs)
    assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]
    others = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=prompts[(i + 3) % 8], sampler=cfg, seed=900 + i,
                                 max_tokens=11 + i) for i in range(1, 8)]
    c = generate_a3b_mtp_batch(lane, [reqs[0]] + others)
    assert c.streams[0].tokens == a.streams[0].tokens
    assert a.accepted_drafts > 0 and a.rejected_drafts > 0


@pytest.mark.parametrize("kind", ARCHS)
def test_compiled_cycle_graphs_carry_recurrent_state(models, kind):
    """GDN caches enter the compiled cycle graphs (state in, per-position capture out): the
    compiled lane runs its verify graph every cycle and decodes exactly what the eager one does,
    greedy and sampled."""
    from mtplx.sampling import SamplerConfig

    m = models[kind]
    compiled, eager = (install_a3b_mtp_batch_lane(m, 4, compiled=c, selfcheck=False) for c in (True, False))
    generate_a3b_mtp_batch(compiled, [_req(i, p, 4) for i, p in enumerate(_prompts(2, seed=5))])
    calls = {"verify": 0}
    assert compiled.span_bucket is None        # recurrent lanes: one graph over the whole buffer
    graph = compiled._graphs[("verify", None)]

    def counted(*args):
        calls["verify"] += 1
        return graph(*args)

    compiled._graphs[("verify", None)] = counted
    prompts = _prompts(4, seed=41)
    for cfg in (GREEDY, SamplerConfig(temperature=0.7)):
        reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=cfg, seed=i, max_tokens=30)
                for i, p in enumerate(prompts)]
        calls["verify"] = 0
        a, b = generate_a3b_mtp_batch(compiled, reqs), generate_a3b_mtp_batch(eager, reqs)
        assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]
        assert a.rejected_drafts > 0 and calls["verify"] == a.cycles


def test_capture_commit_cost_measurement_runs(models):
    """`mtplx bench` reports capture-commit vs a plain verify; it must leave the caches it borrows
    consistent and report both modes."""
    from benchmarks.lane import capture_commit_costs

    out = capture_commit_costs(models["qwen3_5"], 3, ctx=8, n=1)
    assert {"[3,2] compiled plain ms", "[3,2] compiled capture_commit ms", "eager overhead",
            "compiled overhead"} <= set(out)
    assert all(v > 0 for k, v in out.items() if k.endswith(" ms"))


def test_compiled_lane_never_retraces_while_decoding(models, lanes):
    """A row's KV is sized for prompt + max_tokens when it joins, so rows that decode across a
    256-token buffer boundary never retrace the compiled cycle graphs (counted by the lane)."""
    from mtplx.engine.lane import RunningLane

    m, lane = models["qwen3_5"], lanes[("qwen3_5", 3)]
    assert lane.compiled
    running = RunningLane(lane)
    prompts = _prompts(3, seed=51, lengths=(240, 3, 250))
    streams = [running.add(_req(i, p, 40)) for i, p in enumerate(prompts)]
    running.admit_all()
    running.step()                          # may trace at this buffer size (the self-check ran smaller)
    joined = running.counters.graph_retraces
    while running.has_work:
        running.step()
    assert running.counters.graph_retraces == joined and running.counters.cycles > 20
    late = running.add(_req(3, prompts[0] * 2, 40))       # joins later, needs a bigger buffer:
    while running.has_work:                                # draft and verify trace once more
        running.step()
    assert running.counters.graph_retraces == joined + 2
    for s, p in zip(streams + [late], prompts + [prompts[0] * 2]):
        assert s.tokens == greedy_ar(m, p, 40)
