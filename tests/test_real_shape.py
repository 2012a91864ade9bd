"""Checkpoints of real shape (bf16 and 4-bit, 151,936- and 248,320-token vocabularies, tied and
untied, heads that agree often, never, or not at all), written by `mtplx.synthetic`: every route
decodes them greedy (exactly plain greedy) and sampled (reproducibly), the lane installs on a
head that never agrees, and the served app (on the session's Ray Serve) answers chat and /health
on them."""

import json

import mlx.core as mx
import pytest

import mtplx
from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.settings import EngineSettings
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.sampling import GREEDY, SamplerConfig
from mtplx.synthetic import QWEN3_VOCAB, QWEN35_VOCAB, write_checkpoint

from references import greedy_ar

SAMPLED = SamplerConfig(temperature=0.6, top_p=0.95, top_k=0)
KINDS = {
    "qwen3_bf16_tied": dict(arch="qwen3", vocab=QWEN3_VOCAB, tied=True),
    "qwen3_bf16_never": dict(arch="qwen3", vocab=QWEN3_VOCAB, head="never"),
    "qwen3_q4": dict(arch="qwen3", vocab=QWEN3_VOCAB, quantized=True, layers=2),
    "moe_bf16": dict(arch="qwen3_5_moe", vocab=QWEN35_VOCAB),
    "moe_q4_tied": dict(arch="qwen3_5_moe", vocab=QWEN35_VOCAB, quantized=True, tied=True),
    "qwen3_bf16_nohead": dict(arch="qwen3", vocab=QWEN3_VOCAB, head="none", layers=2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_shape")
    return {k: mtplx.load_model(write_checkpoint(root / k, **kw)) for k, kw in KINDS.items()}


def _prompts(model, n):
    texts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
    return [model.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def test_shapes_dtypes_and_quantization(models):
    assert models["moe_bf16"].vocab_size == QWEN35_VOCAB and models["qwen3_bf16_tied"].vocab_size == QWEN3_VOCAB
    for name, m in models.items():
        logits = m.logits(m.hidden(mx.array([[5, 6]]), m.make_cache()))
        assert logits.shape[-1] == m.vocab_size and logits.dtype == mx.bfloat16, name
        assert (m.mtp is None) == name.endswith("nohead")
    q = models["moe_q4_tied"]
    emb = q.arch.text_model(q.target).embed_tokens
    assert emb.bits == 8 and q.arch.text_model(q.target).layers[1].self_attn.q_proj.bits == 4
    assert q.mtp.fc.bits == 4 and q.mtp.fc.group_size == 32 and q.mtp.layers[0].mlp.gate.bits == 8
    # every id decodes (the tokenizer's vocabulary is extended to the model's)
    assert q.tokenizer.decode([QWEN35_VOCAB - 1]) == f"<{QWEN35_VOCAB - 1}>"


@pytest.mark.parametrize("name", [k for k in KINDS if not k.endswith("nohead")])
def test_greedy_mtp_equals_ar_and_sampled_runs(models, name):
    m = models[name]
    n = 6 if "q4" in name else 16
    ids = _prompts(m, 1)[0]
    ar = generate_ar(m, ids, n, GREEDY)
    mtp = generate_mtpk(m, ids, n, GREEDY)
    assert mtp.tokens == ar.tokens
    never_agrees = KINDS[name].get("head") == "never"
    drafts = mtp.stats["accepted_drafts"] + mtp.stats["rejected_drafts"]
    assert drafts > 0 and (mtp.stats["accepted_drafts"] == 0) == never_agrees
    a, b = (generate_mtpk(m, ids, n, SAMPLED, seed=3) for _ in range(2))
    assert a.tokens == b.tokens and len(a.tokens) == n
    assert generate_ar(m, ids, n, SAMPLED, seed=3).tokens == generate_ar(m, ids, n, SAMPLED, seed=3).tokens


@pytest.mark.parametrize("name", ["qwen3_bf16_never", "moe_bf16"])
def test_lane_installs_and_rows_equal_solo(models, name):
    """The self-check forces its commits, so a head that never agrees installs; cohort rows equal
    plain greedy (bf16 within the stated tolerance: none was needed here) and sampled rows are
    reproducible and independent of their neighbours."""
    m = models[name]
    lane = install_a3b_mtp_batch_lane(m, 3)
    assert lane.selfcheck["ok"] and lane.selfcheck["commit_keeps_seen"] == [0, 1, 2]
    assert lane.selfcheck["dtype"] == "bfloat16" and lane.selfcheck["parity_tolerance"] == 9 / 128
    prompts = _prompts(m, 3)
    greedy = generate_a3b_mtp_batch(lane, [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, max_tokens=12)
                                           for i, p in enumerate(prompts)])
    for s, p in zip(greedy.streams, prompts):
        assert s.tokens == greedy_ar(m, p, 12)
    reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=SAMPLED, seed=10 + i, max_tokens=12)
            for i, p in enumerate(prompts)]
    a, b = generate_a3b_mtp_batch(lane, reqs), generate_a3b_mtp_batch(lane, reqs)
    assert [s.tokens for s in a.streams] == [s.tokens for s in b.streams]
    other = [A3BMTPBatchRequest(request_id="x", prompt_ids=prompts[2][:2], sampler=SAMPLED, seed=99, max_tokens=5)]
    c = generate_a3b_mtp_batch(lane, reqs[:1] + other)
    assert c.streams[0].tokens == a.streams[0].tokens


def test_repetition_stop_through_the_service(models):
    """With the repetition stop on (the config's `repetition_stop`: every row armed), a row ends
    when its output repeats (the tied test model repeats one token): its result drops the repeats
    after the first copy and says so; with it off the same row runs to its budget."""
    from mtplx.engine.repetition import RepetitionLimits
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    m = models["qwen3_bf16_tied"]
    ids = _prompts(m, 1)[0]
    ar = greedy_ar(m, ids, 40)
    assert len(set(ar[-12:])) == 1                        # the model does repeat
    results = []
    for limits in (RepetitionLimits(20, 12, 4, 8), None):     # every row armed (the config's repetition_stop), none
        service = MTPBatchGenerationService.for_model(
            m, widths=(3,), batch_wait_s=0.01,
            settings=EngineSettings(repetition_limits=limits, repetition_stop_all=True) if limits else EngineSettings())
        try:
            results.append(service.submit(MTPBatchJob(request_id="r", prompt_ids=ids, max_tokens=40,
                                                      sampler=GREEDY)).result(120))
        finally:
            service.shutdown(timeout_s=30)
    armed, plain = results
    st = armed["stats"]
    assert st["repetition_stop_triggered"] and st["repetition_stop_block_tokens"] == 1
    assert armed["finish_reason"] == "stop" and 20 <= st["repetition_stop_raw_tokens"] <= 22
    assert armed["tokens"] == ar[:st["repetition_stop_raw_tokens"] - st["repetition_stop_trimmed_tokens"]]
    assert plain["tokens"] == ar and not plain["stats"]["repetition_stop_triggered"]


def test_a_checkpoint_without_a_head_serves_plain_ar(models):
    """No MTP head: the service starts with lanes of plain AR rows, every request (whatever its
    generation_mode) decodes exactly as generate_ar, and the snapshot and each result say why."""
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    m = models["qwen3_bf16_nohead"]
    service = MTPBatchGenerationService.for_model(m, widths=(3,), batch_wait_s=0.05)
    try:
        snap = service.snapshot()
        assert "no mtp" in snap["mtp_disabled_reason"] and "AR rows only" in snap["selfchecks"]["3"]["skipped"]
        prompts = _prompts(m, 3)
        jobs = [MTPBatchJob(request_id=f"r{i}", prompt_ids=p, max_tokens=10, seed=i,
                            sampler=GREEDY if i < 2 else SAMPLED) for i, p in enumerate(prompts)]
        results = [f.result(120) for f in service.submit_cohort(jobs)]
    finally:
        service.shutdown(timeout_s=30)
    for i, (r, p) in enumerate(zip(results, prompts)):
        assert r["tokens"] == generate_ar(m, p, 10, GREEDY if i < 2 else SAMPLED, seed=i).tokens
        assert r["stats"]["generation_mode"] == "ar" and "no mtp" in r["stats"]["mtp_disabled_reason"]
    assert results[0]["stats"]["mtp_batch_real_width"] == 3        # greedy and sampled rows shared a lane
    serial = MTPBatchGenerationService.for_model(m, numerics="b1-exact")     # the solo path: AR too
    try:
        r = serial.submit(MTPBatchJob(request_id="s", prompt_ids=prompts[2], max_tokens=10, seed=2,
                                      sampler=SAMPLED)).result(120)
    finally:
        serial.shutdown(timeout_s=30)
    assert r["tokens"] == results[2]["tokens"] and r["stats"]["generation_mode"] == "ar"


@pytest.fixture(scope="module")
def served(models, serve_app):
    """Two more applications on the session's Ray Serve (tests/conftest.py): the tied bf16
    151,936-token checkpoint with its agreeing head, and the one without a head, each under its
    own route prefix, with one B3 lane (no CPU reserved: the session's app holds the cluster's)."""
    import httpx
    from ray import serve

    from deployments import build_app

    apps = {"mtp": "qwen3_bf16_tied", "nohead": "qwen3_bf16_nohead"}
    for prefix, name in apps.items():
        serve.run(build_app({"model_path": str(models[name].path), "widths": [3], "replica_num_cpus": 0,
                             "warmup": False, "default_max_tokens": 24}),
                  name=f"real-shape-{prefix}", route_prefix=f"/real-shape-{prefix}")
    clients = {p: httpx.Client(base_url=f"{serve_app.base}/real-shape-{p}", timeout=300) for p in apps}
    try:
        yield clients
    finally:
        for prefix, c in clients.items():
            c.close()
            serve.delete(f"real-shape-{prefix}")


def _chat_ids(model, content):
    from mtplx.api.openai import ChatMessage, encode_chat

    return encode_chat(model.tokenizer, [ChatMessage(role="user", content=content)])


def _chat(client, model, **body):
    r = client.post("/v1/chat/completions", json={"model": model.path.name, "max_tokens": 24,
                                                   "messages": [{"role": "user", "content": "def fibonacci(n):"}],
                                                   **body})
    assert r.status_code == 200, r.text
    return r.json()


def _expected(model, n=24, decode=generate_ar, sampler=GREEDY, seed=0):
    """`_chat`'s text decoded in process: greedy, or sampled with the request's settings and seed
    (a row's draws depend on its own request alone)."""
    out = decode(model, _chat_ids(model, "def fibonacci(n):"), n, sampler, seed=seed,
                 stop_token_ids=model.eos_token_ids)
    return model.tokenizer.decode([t for t in out.tokens if t not in model.eos_token_ids])


@pytest.mark.ray
def test_real_shape_checkpoint_serves_over_http(models, served):
    """The HTTP route on a bf16 checkpoint of a real vocabulary: greedy chat is plain greedy
    decoding (MTP cycles drafting with the agreeing head, and the default generation mode,
    streamed), a seeded sampled chat repeats itself, and /health reports the model and its lane."""
    m, c = models["qwen3_bf16_tied"], served["mtp"]
    expected = _expected(m)
    greedy = _chat(c, m, temperature=0, generation_mode="mtp")
    assert greedy["choices"][0]["message"]["content"] == expected
    assert greedy["mtplx_stats"]["accepted_drafts"] > 0
    with c.stream("POST", "/v1/chat/completions", json={
            "model": m.path.name, "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "def fibonacci(n):"}]}) as r:
        assert r.status_code == 200
        pieces = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p.get("choices")) == expected
    sampled = [_chat(c, m, temperature=0.7, top_p=0.95, seed=5) for _ in range(2)]
    assert sampled[0]["choices"][0]["message"]["content"] == sampled[1]["choices"][0]["message"]["content"]
    drafting = _chat(c, m, temperature=0.7, top_p=0.95, seed=5, generation_mode="mtp")
    assert drafting["choices"][0]["message"]["content"] == _expected(
        m, decode=generate_mtpk, sampler=SamplerConfig(temperature=0.7, top_p=0.95), seed=5)
    health = c.get("/health").json()
    assert health["status"] == "ok" and health["model"] == m.path.name
    (replica,) = health["replicas"].values()
    assert replica["ok"] and replica["model_id"] == m.model_id and replica["installed_widths"] == [3]


@pytest.mark.ray
def test_a_checkpoint_without_a_head_serves_ar_over_http(models, served):
    """No head: the served app starts, decodes greedy chat as plain greedy, says why in every
    result, and /health reports the model with no lane installed for drafting."""
    m, c = models["qwen3_bf16_nohead"], served["nohead"]
    greedy = _chat(c, m, temperature=0)
    assert greedy["choices"][0]["message"]["content"] == _expected(m)
    stats = greedy["mtplx_stats"]
    assert stats["generation_mode"] == "ar" and "no mtp" in stats["mtp_disabled_reason"]
    sampled = _chat(c, m, temperature=0.7, seed=1)
    assert sampled["choices"][0]["message"]["content"] == _expected(m, sampler=SamplerConfig(temperature=0.7), seed=1)
    health = c.get("/health").json()
    assert health["status"] == "ok" and health["model"] == m.path.name
    (replica,) = health["replicas"].values()
    assert replica["ok"] and replica["model_id"] == m.model_id
