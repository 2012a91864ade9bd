"""HTTP end to end through a real Ray Serve (started once per test session, loopback only).

The app is the product's own `deployments.build_app` with the shipped model; references come from
the engine in this process (`generate_ar`), so "greedy HTTP output == solo AR output" is checked
token for token (through the text and the usage counts).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments._proc import free_port
from deployments.bench_http import BENCH_PROMPTS as PROMPTS

REPO = Path(__file__).resolve().parents[1]
RAY_MARK = pytest.mark.ray

# The @serve.batch window is widened in tests so that "concurrent" requests sent from client
# threads on a loaded 2-core machine reliably share a window; production default is 0.02 s.
TEST_APP_ARGS = {"batch_wait_timeout_s": 0.25, "max_concurrent_batches": 4, "default_max_tokens": 64}
SEED_STATS_KEYS = ("decode_elapsed_s", "decode_tok_s", "scheduler_policy", "mtp_batch_fixed_width",
                   "mtp_batch_route_id")


# ------------------------------------------------------------------------------------------------
# Fixtures: one Ray Serve per session; the engine in-process for references


@pytest.fixture(scope="session")
def serve_app():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from deployments import build_app

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="mtplx-tests",
                 _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(dict(TEST_APP_ARGS)), name="mtplx", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(base=base, api=f"{base}/v1")
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()


@pytest.fixture(scope="session")
def ref_model(model):
    """The engine in this process (tests/conftest.py's shared shipped model), for references."""
    return model


@pytest.fixture()
def client(serve_app):
    import openai

    return openai.OpenAI(base_url=serve_app.api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def http(serve_app):
    import httpx

    with httpx.Client(base_url=serve_app.base, timeout=120) as c:
        yield c


def _chat_ids(model, content: str) -> list:
    from mtplx.server.openai import ChatMessage, encode_chat

    return encode_chat(model.tokenizer, [ChatMessage(role="user", content=content)])


def _reference(model, prompt_ids, max_tokens):
    """(text, completion_tokens, finish_reason) of solo greedy AR, as the server would report."""
    from mtplx.generation import generate_ar
    from mtplx.sampling import SamplerConfig

    r = generate_ar(model, prompt_ids, max_tokens=max_tokens, sampler=SamplerConfig(temperature=0.0),
                    seed=0, stop_token_ids=model.eos_token_ids)
    visible = [t for t in r.tokens if t not in model.eos_token_ids]
    return model.tokenizer.decode(visible, skip_special_tokens=True), len(r.tokens), r.finish_reason


def _snapshot(http) -> dict:
    r = http.get("/v1/mtplx/snapshot")
    assert r.status_code == 200, r.text
    return r.json()


def _replica_sum(snap: dict, key: str) -> int:
    return sum(int(v.get(key) or 0) for v in snap["replicas"].values())


# ------------------------------------------------------------------------------------------------
# No Ray needed


def test_ingress_path_never_imports_mlx():
    code = ("import sys, deployments, deployments.ingress, deployments.app, deployments.router, "
            "mtplx.server.openai\n"
            "bad = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm')]\n"
            "heavy = [m for m in ('mtplx.generation', 'mtplx.models', 'mtplx.a3b_mtp_batch') if m in sys.modules]\n"
            "assert not bad and not heavy, (bad, heavy)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_app_args_are_validated():
    from deployments.app import AppArgs

    assert AppArgs().widths == [3, 8, 16, 32]
    with pytest.raises(Exception):
        AppArgs(widths=[3, 64])
    with pytest.raises(Exception):
        AppArgs(max_batch_size=0)
    with pytest.raises(Exception):
        AppArgs(not_an_arg=1)


# ------------------------------------------------------------------------------------------------
# Through Ray Serve


@RAY_MARK
def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "mtplx-tiny-py"
    health = http.get("/health")
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ok" and body["ingress"]["mlx_imported"] is False
    (rep,) = body["replicas"].values()
    assert rep["ok"] and rep["runtime"]["blas"] and rep["installed_widths"] == [3, 8, 16, 32]


@RAY_MARK
def test_chat_greedy_matches_solo_ar(client, ref_model):
    prompt = PROMPTS[0]
    text, n, reason = _reference(ref_model, _chat_ids(ref_model, prompt), 48)
    r = client.chat.completions.create(model="mtplx-tiny-py", messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=48, seed=7)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(_chat_ids(ref_model, prompt))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    stats = r.model_extra["mtplx_stats"]
    for key in SEED_STATS_KEYS:
        assert key in stats, key
    assert stats["generation_mode"] == "mtp" and stats["decode_tok_s"] > 0


@RAY_MARK
def test_chat_stream_and_completions_match(client, ref_model):
    prompt = PROMPTS[1]
    text, n, reason = _reference(ref_model, _chat_ids(ref_model, prompt), 40)
    chunks = list(client.chat.completions.create(
        model="mtplx-tiny-py", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == reason
    assert all(k in finish[0].model_extra["mtplx_stats"] for k in SEED_STATS_KEYS)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])

    # Legacy completions on raw text, streaming and not, agree with each other and with AR.
    raw = "def add(a, b):\n"
    ids = ref_model.tokenizer.encode(raw, add_special_tokens=False)
    text2, n2, reason2 = _reference(ref_model, ids, 32)
    c = client.completions.create(model="mtplx-tiny-py", prompt=raw, temperature=0, max_tokens=32)
    assert c.object == "text_completion" and c.choices[0].text == text2 and c.usage.completion_tokens == n2
    assert c.choices[0].finish_reason == reason2
    parts = list(client.completions.create(model="mtplx-tiny-py", prompt=ids, temperature=0, max_tokens=32,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == text2
    assert parts[-1].usage.completion_tokens == n2
    no_usage = list(client.completions.create(model="mtplx-tiny-py", prompt=raw, temperature=0, max_tokens=8,
                                              stream=True))
    assert all(getattr(p, "usage", None) is None for p in no_usage)


@RAY_MARK
def test_eight_concurrent_requests_share_one_running_lane(client, http, ref_model):
    refs = [_reference(ref_model, _chat_ids(ref_model, p), 40) for p in PROMPTS]
    before = _snapshot(http)

    def one(i):
        return client.chat.completions.create(
            model="mtplx-tiny-py", messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0,
            max_tokens=40, seed=100 + i)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    widths = []
    for (text, n, reason), r in zip(refs, results):
        stats = r.model_extra["mtplx_stats"]
        assert r.choices[0].message.content == text      # every cohort row is exact vs solo AR
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == reason
        real, fixed = stats["mtp_batch_real_width"], stats["mtp_batch_fixed_width"]
        assert fixed in (1, 3, 8) and real <= fixed
        assert 1 <= stats["lane_mean_occupancy"] <= real and stats["admitted_at_cycle"] >= 0
        widths.append(real)
    # however the windows fell, the rows met in one running lane (no cohort queued behind another)
    assert max(widths) >= 6, widths
    rep, rep0 = next(iter(_snapshot(http)["replicas"].values())), next(iter(before["replicas"].values()))
    assert rep["admissions"] - rep0["admissions"] == 8 and rep["lanes"] == []
    assert rep["lane_row_cycles"] - rep0["lane_row_cycles"] > rep["lane_cycles"] - rep0["lane_cycles"]
    assert rep["fixed_width_histogram"].get("8", 0) > 0


@RAY_MARK
def test_different_sampling_lands_in_different_cohorts(client):
    def one(i):
        sampled = i % 2 == 1
        return client.chat.completions.create(
            model="mtplx-tiny-py", messages=[{"role": "user", "content": PROMPTS[i]}],
            temperature=0.8 if sampled else 0.0, top_p=0.9, max_tokens=12, seed=1000 + i)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for r in results:
        stats = r.model_extra["mtplx_stats"]
        assert stats["mtp_batch_real_width"] <= 4, stats["mtp_batch_real_width"]   # never mixed
    # Seeds are not in the key: same-sampler rows with different seeds share cohorts.
    assert max(r.model_extra["mtplx_stats"]["mtp_batch_real_width"] for r in results) >= 2

    # A row's sampled output depends only on its own request (seed): rerun one alone.
    again = one(1)
    assert again.choices[0].message.content == results[1].choices[0].message.content


@RAY_MARK
def test_ar_generation_mode(client, ref_model):
    prompt = PROMPTS[3]
    text, n, reason = _reference(ref_model, _chat_ids(ref_model, prompt), 24)
    r = client.chat.completions.create(model="mtplx-tiny-py", messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=24, extra_body={"generation_mode": "ar"})
    assert r.choices[0].message.content == text and r.usage.completion_tokens == n
    assert r.model_extra["mtplx_stats"]["generation_mode"] == "ar"


@RAY_MARK
def test_stop_string_cuts_text_and_cancels_row(client, http, ref_model):
    prompt = PROMPTS[4]
    text, n, _ = _reference(ref_model, _chat_ids(ref_model, prompt), 64)
    # A stop string from the middle of the reference output.
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if not stop.strip():
        stop = text[len(text) // 3: len(text) // 3 + 2]
    expected = text[:text.find(stop)]
    before = _replica_sum(_snapshot(http), "requests_cancelled")
    r = client.chat.completions.create(model="mtplx-tiny-py", messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=64, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra["mtplx_stats"].get("stop_string_matched") is True
    s = list(client.chat.completions.create(model="mtplx-tiny-py", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=64, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == expected
    if len(expected) < len(text) - 8:   # the rows stopped early were cancelled at the replica
        deadline = time.time() + 5
        while _replica_sum(_snapshot(http), "requests_cancelled") < before + 2 and time.time() < deadline:
            time.sleep(0.1)
        assert _replica_sum(_snapshot(http), "requests_cancelled") >= before + 2


@RAY_MARK
def test_disconnect_mid_stream_cancels_only_that_row(serve_app, http, ref_model):
    import httpx

    prompts = PROMPTS[:4]
    max_tokens = 160
    refs = [_reference(ref_model, _chat_ids(ref_model, p), max_tokens) for p in prompts]
    before = _snapshot(http)

    def body(p):
        return {"model": "mtplx-tiny-py", "messages": [{"role": "user", "content": p}], "temperature": 0,
                "max_tokens": max_tokens, "stream": True}

    def full_stream(p):
        text, stats = "", None
        with httpx.Client(base_url=serve_app.base, timeout=120) as c:
            with c.stream("POST", "/v1/chat/completions", json=body(p)) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("choices"):
                        text += obj["choices"][0]["delta"].get("content") or ""
                        if obj["choices"][0]["finish_reason"]:
                            stats = obj["mtplx_stats"]
        return text, stats

    def leaver(p):
        got = 0
        with httpx.Client(base_url=serve_app.base, timeout=120) as c:
            with c.stream("POST", "/v1/chat/completions", json=body(p)) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        got += 1
                    if got >= 4:
                        break           # leave mid-stream: the connection is closed here
        return time.time()

    with cf.ThreadPoolExecutor(4) as pool:
        stayers = [pool.submit(full_stream, p) for p in prompts[:3]]
        left_at = pool.submit(leaver, prompts[3]).result()
        # The departed row is cancelled at the replica while its peers still decode.
        deadline = left_at + 10
        cancelled = False
        while time.time() < deadline:
            snap = _snapshot(http)
            if _replica_sum(snap, "requests_cancelled") > _replica_sum(before, "requests_cancelled"):
                cancelled = True
                break
            time.sleep(0.05)
        peers_running = not all(f.done() for f in stayers)
        outs = [f.result() for f in stayers]
    assert cancelled, "the disconnected row was not cancelled"
    for (text, n, reason), (got, stats) in zip(refs[:3], outs):
        assert got == text                       # the others complete identically
        assert stats["completion_tokens"] == n
    if peers_running:   # the cancel landed while the cohort was still running (the usual case)
        assert max(s["mtp_batch_real_width"] for _, s in outs) >= 2


@RAY_MARK
def test_bad_requests_get_openai_errors_and_server_survives(http, client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/chat/completions", {"model": "mtplx-tiny-py"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": msgs, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": msgs, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": msgs, "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/chat/completions", {"messages": msgs, "presence_penalty": 3}, 400, "presence_penalty"),
        ("/v1/chat/completions", {"messages": msgs, "generation_mode": "turbo"}, 400, "generation_mode"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0.type"),
        ("/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": msgs}, 404, "model"),
        ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ]
    for path, payload, status, param in cases:
        r = http.post(path, json=payload)
        assert r.status_code == status, (payload, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, (payload, err)
    overflow = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 100000}).json()
    assert overflow["error"]["code"] == "context_length_exceeded"
    raw = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert http.get("/v1/chat/completions").status_code == 405
    nf = http.get("/v1/nope")
    assert nf.status_code == 404 and nf.json()["error"]["code"] == "not_found"
    gone = http.post("/v1/mtplx/cancel/chatcmpl-does-not-exist")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"
    # The server still answers.
    ok = client.chat.completions.create(model="mtplx-tiny-py", messages=msgs, temperature=0, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


@RAY_MARK
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MTPLX_SCALEOUT_TEST") != "1",
                    reason="opt-in (MTPLX_SCALEOUT_TEST=1): the local multi-node cluster's nodes talk over "
                           "the machine's interface address, not loopback")
def test_scale_out_two_nodes_two_replicas():
    """Two nodes with {"mlx": 1} each, two replicas: cohorts are served by both.

    Runs `python -m deployments.scaleout` in a subprocess (its own multi-node Ray cluster, so it does
    not clash with the session's Ray). Heavy on a 2-core machine (~1 min): marked slow. Opt-in:
    Ray's multi-node syncer fails when every node is pinned to 127.0.0.1 here, so the nodes use the
    machine's own interface address, and tests by default keep all traffic on loopback."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run([sys.executable, "-m", "deployments.scaleout", "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    assert len(report["cohorts_by_replica"]) == 2 and all(v > 0 for v in report["cohorts_by_replica"].values())
    assert len(set(report["replica_nodes"].values())) == 2


@RAY_MARK
def test_cancel_endpoint_stops_an_in_flight_request(serve_app, http):
    import httpx

    body = {"model": "mtplx-tiny-py", "messages": [{"role": "user", "content": PROMPTS[5]}], "temperature": 0,
            "max_tokens": 400, "stream": True}
    finish, n_chunks = None, 0
    with httpx.Client(base_url=serve_app.base, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            rid = resp.headers["x-mtplx-request-id"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n_chunks += 1
                if n_chunks == 3:
                    r = http.post(f"/v1/mtplx/cancel/{rid}")
                    assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
                obj = json.loads(line[6:])
                if obj.get("choices") and obj["choices"][0]["finish_reason"]:
                    finish = obj["choices"][0]["finish_reason"]
                    stats = obj["mtplx_stats"]
    assert finish == "cancelled" and stats["completion_tokens"] < 400


@pytest.mark.parametrize("name", ["config.yaml", "apple_silicon_qwen36_35b_a3b.yaml"])
def test_serve_configs_are_valid(name):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import INGRESS_NAME, REPLICA_NAME, AppArgs

    cfg = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve_configs" / name).read_text()))
    (app,) = cfg.applications
    assert app.import_path == "deployments:build_app"
    args = AppArgs(**app.args)
    assert args.max_batch_size * args.max_concurrent_batches <= next(
        d.max_ongoing_requests for d in app.deployments if d.name == INGRESS_NAME)
    assert {d.name for d in app.deployments} <= {INGRESS_NAME, REPLICA_NAME}
    assert cfg.http_options.host == "127.0.0.1"


@RAY_MARK
def test_non_streaming_client_that_leaves_cancels_its_row(serve_app, http):
    import httpx

    before = _replica_sum(_snapshot(http), "requests_cancelled")
    body = {"model": "mtplx-tiny-py", "messages": [{"role": "user", "content": PROMPTS[6]}], "temperature": 0,
            "max_tokens": 600}
    with httpx.Client(base_url=serve_app.base, timeout=httpx.Timeout(60, read=0.6)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    deadline = time.time() + 10
    while _replica_sum(_snapshot(http), "requests_cancelled") <= before and time.time() < deadline:
        time.sleep(0.1)
    assert _replica_sum(_snapshot(http), "requests_cancelled") > before


def test_grafana_dashboard_uses_exported_metric_names():
    import re

    dash = json.loads((REPO / "serve_configs" / "grafana_mtplx_dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    code = (REPO / "deployments" / "replica.py").read_text() + (REPO / "deployments" / "ingress.py").read_text()
    for name in set(re.findall(r"ray_(mtplx_[a-z_]+?)(?:_total|_bucket|_sum|_count)?\b", exprs)):
        assert f'"{name}"' in code, name
