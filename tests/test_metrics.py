"""Metrics: the exported series, the cohort monitor on a real service, the shipped Grafana dashboard
and the row we add to Ray's Core dashboard. (The Prometheus end-to-end check is in test_http.py,
beside the session's Ray Serve.)"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict

import pytest

from deployments import grafana
from deployments.metrics import (INGRESS_SERIES, LANE_ROUTES, RAY_SERVE_SERIES, REPLICA_SERIES, CohortMonitor,
                                 exported_names, lane_route_label)


def dashboard_exprs(dash: dict) -> list:
    return [t["expr"] for p in grafana._all_panels(dash["panels"]) for t in p.get("targets", ())]


def series_in(expr: str) -> set:
    return set(re.findall(r"\bray_[a-zA-Z0-9_]+", expr))


def test_series_names_are_valid_and_follow_vllm():
    names = [name for table in (REPLICA_SERIES, INGRESS_SERIES) for _, name, *_ in table.values()]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n) for n in names)
    for vllm in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos"):
        assert f"mtplx_{vllm}" in names
    # bounded labels only: nothing keyed by request, path or user text
    tag_keys = {k for table in (REPLICA_SERIES, INGRESS_SERIES) for *_, tags, _ in table.values() for k in tags}
    assert tag_keys <= {"position", "lane", "width", "kind", "generation_mode", "finish_reason", "route", "status",
                        "reason", "sampling", "hit", "outcome"}
    # a lane's label is its route (the key is the model id now); an unknown route stays bounded
    assert [lane_route_label(ln) for ln in ({"key": "mtplx-tiny-py", "route": "mixed"},
                                            {"key": "m", "route": "user text"})] == ["mixed", "other"]


def test_dashboard_expressions_name_exported_series():
    dash = grafana.load_dashboard()
    exported = exported_names() | set(RAY_SERVE_SERIES)
    exprs = dashboard_exprs(dash)
    assert exprs
    named = set()
    for expr in exprs:
        assert series_in(expr), expr
        assert series_in(expr) <= exported, (expr, series_in(expr) - exported)
        named |= series_in(expr)
    # the series a serving engineer looks for are all plotted
    for must in ("ray_mtplx_spec_decode_num_accepted_tokens_total", "ray_mtplx_waiting_rows",
                 "ray_mtplx_lane_live_rows", "ray_mtplx_lane_cycle_time_seconds_bucket",
                 "ray_mtplx_time_to_first_token_seconds_bucket", "ray_mtplx_requests_finished_total",
                 "ray_mtplx_prefix_cache_hits_total", "ray_mtplx_spec_decode_acceptance_length_bucket",
                 "ray_mtplx_running_lanes", "ray_mtplx_lane_rows", "ray_mtplx_prefix_cache_requests_total",
                 "ray_mtplx_routing_decisions_total", "ray_mtplx_rows_moved_total"):
        assert must in named, must
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    # lanes per route and their rows: an operator sees rows split over lanes
    by_title = {p["title"]: p for p in dash["panels"]}
    lanes = by_title["Running lanes and their rows by route"]
    assert [t["expr"] for t in lanes["targets"]] == ["sum by (route) (ray_mtplx_running_lanes)",
                                                     "sum by (route, sampling) (ray_mtplx_lane_rows)"]
    assert "one lane per model" in lanes["description"]
    # no two panels overlap on the grid (24 columns)
    grid = [p["gridPos"] for p in dash["panels"]]
    cells = [(x, y) for g in grid for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])]
    assert all(x < 24 for x, _ in cells)
    assert len(set(cells)) == len(cells)


class _Rec:
    def __init__(self, calls, key):
        self.calls, self.key = calls, key


class _Counter(_Rec):
    def inc(self, value, tags=None):
        assert value > 0   # Ray's Counter refuses anything else
        self.calls[self.key].append((value, tuple(sorted((tags or {}).items()))))


class _Gauge(_Rec):
    def set(self, value, tags=None):
        self.calls[self.key].append((value, tuple(sorted((tags or {}).items()))))


class _Histogram(_Rec):
    def observe(self, value, tags=None):
        self.calls[self.key].append((value, ()))


def recording_metrics():
    calls = defaultdict(list)
    cls = {"counter": _Counter, "gauge": _Gauge, "histogram": _Histogram}
    return calls, {k: cls[spec[0]](calls, k) for k, spec in REPLICA_SERIES.items()}


def _lane(serial, route, live, greedy, width=8, **kw):
    """A snapshot lane as MTPBatchGenerationService.snapshot() writes one (the fields the monitor reads)."""
    return dict({"key": "mtplx-tiny-py", "width": width, "route": route, "depth": 1, "greedy_rows": greedy,
                 "depth_switches": 0, "live_rows": live, "prefilling_rows": 0, "waiting_rows": 0, "cycles": 10,
                 "serial": serial, "admitted": live, "row_cycles": 10 * live, "accepted": 4, "rejected": 2,
                 "step_policy": {"kind": "mtp", "acceptance": 0.6}}, **kw)


def _last(calls, key) -> dict:
    """The last value each label set of a recorded series was set to."""
    return {tags: v for v, tags in calls[key]}


def test_lane_gauges_by_route():
    """Running lanes by route and their live rows by the rows' own sampling, from the snapshot's
    lanes; the lane label of the lane series is the route; a lane that goes away reads 0 (once)."""
    snap = {"pending": 1, "lanes": []}
    calls, metrics = recording_metrics()
    monitor = CohortMonitor(lambda: snap, metrics, logging.getLogger("test"), log_every_s=0)
    snap = {"pending": 1, "lanes": [_lane(1, "greedy", live=3, greedy=3, width=3),
                                    _lane(2, "mixed", live=5, greedy=2, waiting_rows=2),
                                    _lane(3, "idle", live=0, greedy=0, width=1, prefilling_rows=1)]}
    monitor.sample()
    R, S = (("route", "greedy"),), (("route", "mixed"),)
    assert _last(calls, "running_lanes") == {R: 1, S: 1, (("route", "idle"),): 1}
    assert _last(calls, "lane_rows") == {(("route", "greedy"), ("sampling", "greedy")): 3,
                                         (("route", "mixed"), ("sampling", "greedy")): 2,
                                         (("route", "mixed"), ("sampling", "sampled")): 3}
    assert _last(calls, "live_rows") == {(("lane", "greedy"), ("width", "3")): 3,
                                         (("lane", "mixed"), ("width", "8")): 5,
                                         (("lane", "idle"), ("width", "1")): 0}
    assert _last(calls, "waiting_rows") == {(("lane", "queue"),): 1, (("lane", "greedy"),): 0,
                                            (("lane", "mixed"),): 2, (("lane", "idle"),): 1}
    assert (0.6, (("lane", "mixed"), ("width", "8"))) in calls["lane_acceptance"]
    assert {v for k in REPLICA_SERIES for _, tags in calls[k] for t, v in tags if t in ("lane", "route")} <= \
        set(LANE_ROUTES) | {"queue"}   # bounded: never the model id

    # the mixed lane ends, the greedy lane's rows turn mixed: what went away reads 0
    snap = {"pending": 0, "lanes": [_lane(1, "mixed", live=3, greedy=1, width=3)]}
    calls.clear()
    monitor.sample()
    assert _last(calls, "running_lanes") == {R: 0, S: 1, (("route", "idle"),): 0}
    assert _last(calls, "lane_rows") == {(("route", "greedy"), ("sampling", "greedy")): 0,
                                         (("route", "mixed"), ("sampling", "greedy")): 1,
                                         (("route", "mixed"), ("sampling", "sampled")): 2}
    snap = {"pending": 0, "lanes": []}
    monitor.sample()
    calls.clear()
    monitor.sample()   # zeroed once, then left alone
    assert not calls["running_lanes"] and not calls["lane_rows"]


def test_summary_names_each_lanes_routes():
    """The periodic summary line: the lane (its model id) with the routes it took in the period
    (idle only when it had no live row), then its width."""
    lane = _lane(1, "idle", live=0, greedy=0, cycles=0, row_cycles=0, accepted=0, rejected=0, admitted=0)
    snap = {"lanes": [lane]}
    monitor = CohortMonitor(lambda: snap, None, logging.getLogger("test"), log_every_s=0)
    for route, live, greedy in (("idle", 0, 0), ("greedy", 2, 2), ("mixed", 4, 2), ("greedy", 1, 1)):
        snap = {"lanes": [dict(lane, route=route, live_rows=live, greedy_rows=greedy, admitted=4,
                               cycles=8, row_cycles=16, accepted=6, rejected=2)]}
        monitor.sample()
    line = monitor.summary()
    assert re.search(r"\| lane mtplx-tiny-py\[greedy\+mixed\] w8: admitted 4, finished \d+, occupancy 2\.00/8, "
                     r"acceptance 0\.75", line), line
    snap = {"lanes": [dict(lane, route="idle", width=8)]}
    monitor.sample()
    assert "| lane mtplx-tiny-py[idle] w8: admitted 0" in monitor.summary()


def test_cohort_monitor_on_a_real_service(model, caplog):
    """Three greedy rows through a real service: the monitor's metric increments add up to the
    service's own counters, lane gauges read the live rows and the step choice (kind, acceptance
    estimate, cost model) and fall to 0 when the lane ends, and the summary names the lane with its
    occupancy and acceptance."""
    from mtplx.sampling import SamplerConfig
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob, mtp_batch_compatibility_key

    greedy = SamplerConfig(temperature=0.0)
    key = mtp_batch_compatibility_key(model.model_id)
    # the B3 lane chains 2 drafts a cycle: proposals, draft tokens and positions differ
    service = MTPBatchGenerationService.for_model(model, widths=(3,), batch_wait_s=0.0, greedy_depths={3: 2})
    try:
        calls, metrics = recording_metrics()
        monitor = CohortMonitor(service.snapshot, metrics, logging.getLogger("test"), log_every_s=0)
        before = service.snapshot()
        prompt = list(model.tokenizer.encode("def fibonacci(n):\n", add_special_tokens=False))
        jobs = [MTPBatchJob(request_id=f"m{i}", prompt_ids=prompt, max_tokens=48, sampler=greedy, seed=i,
                            compatibility_key=key) for i in range(3)]
        futures = service.submit_cohort(jobs)
        while not all(f.done() for f in futures):
            monitor.sample()
            time.sleep(0.02)
        for f in futures:
            f.result()
        deadline = time.time() + 10
        while service.snapshot()["lanes"] and time.time() < deadline:
            time.sleep(0.01)
        after = monitor.sample()
        line = monitor.summary()
    finally:
        service.shutdown()

    total = lambda k: sum(v for v, _ in calls[k])  # noqa: E731
    accepted = after["accepted_draft_tokens"] - before["accepted_draft_tokens"]
    rejected = after["rejected_draft_tokens"] - before["rejected_draft_tokens"]
    assert accepted + rejected > 0
    assert total("accepted") == accepted == total("accepted_per_pos")
    by_pos = {dict(t)["position"] for v, t in calls["accepted_per_pos"] if v > 0}
    assert by_pos == {"0", "1"}
    proposals = after["draft_proposals"] - before["draft_proposals"]
    assert total("drafts") == proposals and total("draft_tokens") == 2 * proposals
    assert proposals >= rejected and accepted + rejected > proposals
    assert total("lane_cycles") == after["lane_cycles"] - before["lane_cycles"]
    assert total("row_cycles") == after["lane_row_cycles"] - before["lane_row_cycles"]
    assert total("steps") == sum(after[k] - before[k] for k in ("mtp_cycles", "ar_steps")) > 0
    assert total("admissions") == 3
    assert calls["cycle_time"] and all(0 < v < 5 for v, _ in calls["cycle_time"])
    live = [(v, dict(tags)) for v, tags in calls["live_rows"]]
    assert any(v > 0 and t == {"lane": "greedy", "width": "3"} for v, t in live)
    assert live[-1][0] == 0   # the ended lane reads 0, not its last value
    assert any(dict(tags) == {"lane": "queue"} for _, tags in calls["waiting_rows"])
    lane3 = {"lane": "greedy", "width": "3"}
    assert any(v == 1.0 and dict(t) == lane3 for v, t in calls["lane_speculating"])
    assert any(0 <= v <= 2 and dict(t) == lane3 for v, t in calls["lane_acceptance"])   # chains of 2
    costs = {dict(t)["kind"] for v, t in calls["lane_step_cost"] if v > 0}
    assert costs == {"mtp", "ar"}, calls["lane_step_cost"]
    assert calls["lane_speculating"][-1][0] == 0   # the ended lane reads 0
    assert line is not None and "lane " in line and " w3: admitted 3, finished 3" in line, line
    assert "acceptance" in line and "tok/s" in line
    assert monitor.summary() is None   # nothing ran since: no line
    # the recent decode rate: a token per live row and cycle plus each accepted draft, per second
    (t0, n0), (t1, n1) = monitor._decoded[0], monitor._decoded[-1]
    assert n1 == after["lane_row_cycles"] + after["accepted_draft_tokens"]
    assert 0 < n1 - n0 <= (after["lane_row_cycles"] - before["lane_row_cycles"]) + accepted
    assert monitor.decode_tok_s(window_s=t1 - t0) == pytest.approx((n1 - n0) / (t1 - t0))
    assert monitor.decode_tok_s(window_s=0) is None   # one sample in the window: no rate


def core_dashboard() -> dict:
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_default_grafana_dashboard

    content, uid = generate_default_grafana_dashboard()
    assert uid == "rayDefaultDashboard"
    return json.loads(content)


def test_core_dashboard_row(tmp_path, monkeypatch):
    """Our row on Ray's own Core dashboard: valid JSON, ids that do not clash with Ray's, our
    panels first and Ray's below, expressions that name exported series, and re-applying it (a
    second app start) changes nothing."""
    core = core_dashboard()
    ray_ids = {p["id"] for p in grafana._all_panels(core["panels"])}
    d = tmp_path / "dashboards"
    d.mkdir()
    (d / grafana.CORE_DASHBOARD_FILE).write_text(json.dumps(core))
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(d))
    written = grafana.provision()
    assert written == {"dashboard": str(d / grafana.OUR_DASHBOARD_FILE), "core_row": str(d / grafana.CORE_DASHBOARD_FILE)}
    assert json.loads((d / grafana.OUR_DASHBOARD_FILE).read_text()) == grafana.load_dashboard()
    once = json.loads((d / grafana.CORE_DASHBOARD_FILE).read_text())
    assert once["uid"] == "rayDefaultDashboard"
    panels = grafana._all_panels(once["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    ours = [p for p in panels if p["id"] not in ray_ids]
    assert [p["title"] for p in ours] == [grafana.ROW_TITLE, *grafana.ROW_PANELS]
    assert min(p["id"] for p in ours) > max(ray_ids)
    assert once["panels"][0]["type"] == "row" and once["panels"][0]["gridPos"]["y"] == 0
    our_bottom = max(grafana._bottom(p) for p in ours)
    assert all(p["gridPos"]["y"] >= our_bottom for p in panels if p["id"] in ray_ids)
    for expr in dashboard_exprs({"panels": ours}):
        assert series_in(expr) and series_in(expr) <= exported_names() | set(RAY_SERVE_SERIES), expr
    grafana.provision()
    assert json.loads((d / grafana.CORE_DASHBOARD_FILE).read_text()) == once
    # Ray rewrites its file at a new session: ours goes on top again
    (d / grafana.CORE_DASHBOARD_FILE).write_text(json.dumps(core))
    grafana.provision()
    assert json.loads((d / grafana.CORE_DASHBOARD_FILE).read_text()) == once


def test_provision_needs_rays_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(tmp_path / "absent"))
    assert grafana.provision() is None
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR")
    monkeypatch.delenv("RAY_METRICS_OUTPUT_ROOT", raising=False)
    assert grafana.dashboards_dir("/s") == pytest.importorskip("pathlib").Path("/s/metrics/grafana/dashboards")


# ------------------------------------------------------------------------------------------------
# Through the session's Ray Serve (tests/conftest.py)

LONG_PROMPT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(48))   # > 256 tokens


def _traffic_round(serve_app) -> None:
    """One round of what an operator watches: concurrent greedy and sampled rows, a repeated long
    prompt (a prefix-cache hit), and a client that leaves mid-stream (a cancel)."""
    import concurrent.futures as cf

    import httpx

    def post(body):
        with httpx.Client(base_url=serve_app.base, headers=serve_app.headers, timeout=120) as c:
            return c.post("/v1/completions", json=dict(body, model="mtplx-tiny-py")).status_code

    def leave_mid_stream():
        with httpx.Client(base_url=serve_app.base, headers=serve_app.headers, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={"model": "mtplx-tiny-py", "prompt": "def main():\n",
                                                           "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 3:
                        break

    bodies = ([{"prompt": f"def g{i}(n):\n", "max_tokens": 48, "temperature": 0, "stream": True} for i in range(4)]
              + [{"prompt": "class Node:\n", "max_tokens": 32, "temperature": 0.7, "seed": 1}]
              + [{"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}])
    with cf.ThreadPoolExecutor(8) as ex:
        statuses = list(ex.map(post, bodies))
        ex.submit(leave_mid_stream).result()
    assert statuses == [200] * len(bodies)
    assert post({"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}) == 200


@pytest.mark.ray
def test_replica_log_has_cohort_summaries(serve_app):
    """With nothing installed, the replica's log (the Ray dashboard: Serve, the deployment, the
    replica, Logs) carries the periodic cohort summary."""
    from ray._private import worker

    logs = __import__("pathlib").Path(worker._global_node.get_session_dir_path()) / "logs" / "serve"
    _traffic_round(serve_app)
    deadline = time.time() + 30
    lines = []
    while time.time() < deadline and not lines:
        time.sleep(1)
        lines = [ln for f in logs.glob("replica_*MTPReplica*.log") for ln in f.read_text(errors="replace").splitlines()
                 if "mtplx replica" in ln and " tok/s, " in ln and "| lane " in ln]
    assert lines, f"no cohort summary in {sorted(p.name for p in logs.glob('replica_*'))}"
    assert re.search(r"lane \S+ w\d+: admitted \d+, finished \d+, occupancy [\d.]+/\d+, acceptance", lines[-1])


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("prometheus") is None,
                    reason="needs Prometheus (bash scripts/metrics.sh installs Debian's package)")
def test_prometheus_evaluates_every_dashboard_expression(serve_app, tmp_path):
    """scripts/metrics.sh runs Prometheus on a scrape config for the test cluster's metrics agent;
    with traffic flowing, every PromQL expression of the shipped dashboard returns a finite value
    through Prometheus's HTTP API. (Ray exports metrics every 10 s: this takes about a minute.)"""
    import math
    import os
    import subprocess
    import threading

    import httpx
    import ray

    from deployments._proc import free_port

    node = next(n for n in ray.nodes() if n["Alive"])
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 2s\nscrape_configs:\n  - job_name: ray\n    static_configs:\n"
                      f"      - targets: ['{node['NodeManagerAddress']}:{node['MetricsExportPort']}']\n")
    port = free_port()
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(["bash", str(repo / "scripts" / "metrics.sh"), str(config)], stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, MTPLX_PROMETHEUS_PORT=str(port)))
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            _traffic_round(serve_app)

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    exprs = dashboard_exprs(grafana.load_dashboard())
    missing = list(exprs)
    try:
        deadline = time.time() + 240
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as prom:
            while missing and time.time() < deadline and proc.poll() is None and feeder.is_alive():
                time.sleep(3)
                still = []
                for expr in missing:
                    try:
                        r = prom.get("/api/v1/query", params={"query": expr}).json()
                    except httpx.HTTPError:
                        still.append(expr)
                        continue
                    assert r["status"] == "success", (expr, r)
                    if not any(math.isfinite(float(s["value"][1])) for s in r["data"]["result"]):
                        still.append(expr)
                missing = still
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)
        feeder.join(120)
    assert proc.returncode is not None
    assert not missing, (missing, (tmp_path / "prometheus.log").read_text()[-2000:])


@pytest.mark.ray
@pytest.mark.skipif(__import__("shutil").which("chromium") is None, reason="needs Debian's chromium (headless)")
def test_live_page_in_headless_chromium(serve_app, tmp_path):
    """The live page, served without a key and fetching nothing from elsewhere, shows the running
    lanes, acceptance and tokens/s in headless Chromium while traffic runs; the screenshot is kept
    in build/test-artifacts/live_page.png."""
    import shutil
    import subprocess
    import threading

    import httpx
    from conftest import TEST_API_KEY

    url = serve_app.base + "/v1/mtplx/dashboard"
    page = httpx.get(url, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", page.text)   # nothing from elsewhere
    assert httpx.get(serve_app.base + "/v1/mtplx/snapshot", timeout=30).status_code == 401   # the data needs the key

    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            _traffic_round(serve_app)

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    chrome = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900", "--virtual-time-budget=12000"]
    shot = tmp_path / "live_page.png"
    try:
        time.sleep(3)   # rows in flight before the page's first snapshot
        dom = subprocess.run(chrome + ["--dump-dom", f"{url}#key={TEST_API_KEY}"], capture_output=True, text=True,
                             timeout=120).stdout
        subprocess.run(chrome + [f"--screenshot={shot}", f"{url}#key={TEST_API_KEY}"], capture_output=True,
                       timeout=120, check=True)
        snap = httpx.get(serve_app.base + "/v1/mtplx/snapshot", timeout=30,
                         headers={"Authorization": f"Bearer {TEST_API_KEY}"}).json()
    finally:
        stop.set()
        feeder.join(120)
    assert 'id="status" class="">live' in dom, dom[:2000]
    tps = re.search(r'id="tps">(\d+\.\d)<', dom)
    # tokens flowed: the page shows the replicas' own 5 s rate (its snapshots come within
    # milliseconds of each other under headless virtual time)
    assert tps and float(tps.group(1)) > 0, dom[:3000]
    assert any((r.get("decode_tok_s_5s") or 0) > 0 for r in snap["replicas"].values()), snap["replicas"]
    assert "started at width" in dom   # the recent-lanes log saw lanes come
    assert shot.stat().st_size > 20_000
    keep = __import__("pathlib").Path(__file__).resolve().parents[1] / "build" / "test-artifacts"
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, keep / "live_page.png")


def test_finish_reason_labels_stay_bounded_and_a_stop_string_is_a_stop():
    from deployments.metrics import FINISH_REASONS, error_label, finish_reason_label
    from mtplx.end import KINDS, End

    assert finish_reason_label(End("stop_string")) == "stop"
    assert finish_reason_label(End("cancelled")) == "cancelled"
    assert all(finish_reason_label(End(kind)) in FINISH_REASONS for kind in KINDS)
    assert error_label("a user string") == "other" and error_label(None) == "other"
    assert all(error_label(r) == r for r in FINISH_REASONS)
