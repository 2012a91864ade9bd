"""`bench_http`: what the HTTP / Ray Serve path costs over the in-process service.

Arms, interleaved round by round on the same machine:
  * in-process: `MTPBatchGenerationService.submit_cohort` of the same greedy rows (chat-templated
    prompts, eos as stop ids, so both arms decode exactly the same tokens);
  * HTTP: the same rows as concurrent `/v1/chat/completions` requests (streaming SSE, and
    non-streaming JSON) through the Serve app.
Reported: aggregate tok/s of each arm and their ratio (target >= 0.85), for `n_rows` (8) and for a
2-row cohort; and time to first token of a lone request, HTTP vs in-process (target overhead
<= 30 ms median). The lone in-process arm is `service.submit` (the service's own 20 ms gather
window, like the ingress's `@serve.batch` window); the no-wait `submit_cohort` figure is reported
too. And what the metrics and the live page cost (target <= 2%): the `n_rows` SSE wave against the
app with metrics on while its snapshot is polled once a second (the live page), and against a
copy of the app with `metrics: false` on the same Serve, arms alternating.

    from benchmarks.http import bench_http
    report = bench_http()                     # starts a local Ray Serve on a free loopback port
    report = bench_http(base_url="http://127.0.0.1:8000")   # or measure a running server

`python -m benchmarks.http [--json]` prints the report.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Optional

from deployments._proc import free_port

BENCH_PROMPTS = (
    "def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\n",
    "for i in range(10):\n", "def read_lines(path):\n    with open(path) as f:", "try:\n    import json",
    "    def __repr__(self):\n        return", "if __name__ == '__main__':\n",
)


async def _http_row(client, url: str, body: dict, stream: bool) -> dict:
    t0 = time.perf_counter()
    ttft, tokens, text = None, None, []
    if not stream:
        r = await client.post(url, json=body)
        r.raise_for_status()
        obj = r.json()
        return {"t0": t0, "end": time.perf_counter(), "ttft": None,
                "completion_tokens": obj["usage"]["completion_tokens"], "text": obj["choices"][0]["message"]["content"]}
    async with client.stream("POST", url, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices"):
                piece = obj["choices"][0]["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            elif obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return {"t0": t0, "end": time.perf_counter(), "ttft": ttft, "completion_tokens": tokens, "text": "".join(text)}


async def _http_wave(client, bodies: list, stream: bool, prefix: str = "", watch_page: bool = False) -> dict:
    """The rows as concurrent requests to the app at `prefix`; `watch_page`: meanwhile poll its
    snapshot once a second, as the live page does."""
    async def page():
        while True:
            await client.get(f"{prefix}/v1/mtplx/snapshot")
            await asyncio.sleep(1.0)

    watcher = asyncio.ensure_future(page()) if watch_page else None
    t0 = time.perf_counter()
    try:
        rows = await asyncio.gather(*[_http_row(client, f"{prefix}/v1/chat/completions", b, stream) for b in bodies])
    finally:
        if watcher is not None:
            watcher.cancel()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "rows": rows, "tokens": sum(r["completion_tokens"] or 0 for r in rows)}


def _inproc_cohort(service, mtp_batch, prompts, max_tokens, eos, sampler, key, submit_each: bool = False) -> dict:
    """The rows in-process: one `submit_cohort` (no gather window), or one `submit` per row
    (through the service's gather window, like requests arriving at the ingress)."""
    first = {}

    def cb_for(i):
        def cb(toks):
            if i not in first:
                first[i] = time.perf_counter()
        return cb

    jobs = [mtp_batch.MTPBatchJob(request_id=f"bench-{i}", prompt_ids=p, max_tokens=max_tokens, sampler=sampler,
                                  seed=i, stop_token_ids=eos, token_callback=cb_for(i), compatibility_key=key)
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    futures = [service.submit(j) for j in jobs] if submit_each else service.submit_cohort(jobs)
    results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(r["completion_tokens"] for r in results),
            "ttft": [first.get(i, t0) - t0 for i in range(len(jobs))], "results": results}


def _inproc_lone_ttft(service, mtp_batch, prompt, max_tokens, eos, sampler, key, submit_each: bool) -> float:
    return _inproc_cohort(service, mtp_batch, [prompt], max_tokens, eos, sampler, key, submit_each)["ttft"][0]


def _replica_blas_threads(base_url: str) -> Optional[int]:
    import httpx

    try:
        health = httpx.get(f"{base_url}/health", timeout=60).json()
        threads = {r.get("blas_threads") for r in health.get("replicas", {}).values() if isinstance(r, dict)}
        threads.discard(None)
        return min(threads) if threads else None
    except Exception:
        return None


NO_METRICS_PREFIX = "/no-metrics"


def _start_local_serve(app_args: Optional[dict], metrics_arm: bool = False) -> tuple:
    """A Ray Serve on a free loopback port with the app at /; with `metrics_arm`, a second copy
    of it without metrics at NO_METRICS_PREFIX (its own replica; the arms take turns)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from deployments import build_app

    ray.init(include_dashboard=False, log_to_driver=False, namespace="mtplx-bench")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(dict(app_args or {})), name="mtplx-bench", route_prefix="/")
    if metrics_arm:
        serve.run(build_app({**(app_args or {}), "metrics": False}), name="mtplx-bench-no-metrics",
                  route_prefix=NO_METRICS_PREFIX)

    def stop():
        serve.shutdown()
        ray.shutdown()

    return f"http://127.0.0.1:{port}", stop


def bench_http(model_path: Optional[str] = None, n_rows: int = 8, max_tokens: int = 256, rounds: int = 3,
               lone_rounds: int = 10, two_row_case: bool = True, base_url: Optional[str] = None,
               app_args: Optional[dict] = None, model_name: Optional[str] = None, settle_s: float = 0.3,
               metrics_arm: bool = True) -> dict:
    """Run the HTTP-vs-in-process benchmark; returns a JSON-able report (see module docstring).
    `metrics_arm` (a local Serve only): the n_rows case also runs against a copy of the app without
    metrics, to measure what the metrics and the live page cost."""
    import mtplx
    from mtplx.runtime import set_blas_threads
    from mtplx.sampling import SamplerConfig
    from mtplx.server import mtp_batch
    from mtplx.api.openai import ChatMessage, encode_chat

    model = mtplx.load_model(model_path)
    greedy = SamplerConfig(temperature=0.0)
    key = ("bench", "greedy")
    eos = model.eos_token_ids
    name = model_name or model.model_id
    contents = [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n_rows)]
    prompts = [encode_chat(model.tokenizer, [ChatMessage(role="user", content=c)]) for c in contents]

    def bodies(k, mt):
        return [{"model": name, "messages": [{"role": "user", "content": contents[i]}], "temperature": 0,
                 "max_tokens": mt, "seed": i} for i in range(k)]

    stop = None
    if base_url is None:
        args = {"model_path": model_path, **(app_args or {})}
        metrics_arm = metrics_arm and args.get("metrics", True) is not False
        base_url, stop = _start_local_serve(args, metrics_arm)
    else:
        metrics_arm = False
    # Same BLAS thread count in both arms (the replica reports its own in /health).
    replica_threads = _replica_blas_threads(base_url)
    inproc_threads = set_blas_threads(replica_threads)
    service = mtp_batch.MTPBatchGenerationService.for_model(model, widths=(3, 8))
    report = {"base_url": base_url, "model": name, "n_rows": n_rows, "max_tokens": max_tokens, "rounds": rounds,
              "runtime": mtplx.runtime_info(), "settle_s": settle_s,
              "blas_threads": {"replica": replica_threads, "in_process": inproc_threads}}
    try:
        report.update(asyncio.run(_bench_async(
            base_url, service, mtp_batch, prompts, bodies, n_rows, max_tokens, rounds, lone_rounds, two_row_case,
            eos, greedy, key, settle_s, metrics_arm)))
        report["targets"] = {
            "aggregate_ratio_target": 0.85,
            "aggregate_ratio_stream": report["cohort"]["ratio_stream"],
            "aggregate_ratio_json": report["cohort"]["ratio_json"],
            "ttft_overhead_target_ms": 30.0,
            "ttft_overhead_ms": report["lone_ttft"]["overhead_ms_vs_submit"],
            "metrics_cost_pct_target": 2.0,
            "metrics_cost_pct": (report["cohort"].get("metrics") or {}).get("cost_pct"),
        }
        try:
            import httpx

            report["server_snapshot"] = httpx.get(f"{base_url}/v1/mtplx/snapshot", timeout=30).json()
        except Exception as exc:  # informational only
            report["server_snapshot"] = {"error": str(exc)}
    finally:
        service.shutdown()
        if stop is not None:
            stop()
    return report


async def _bench_async(base_url, service, mtp_batch, prompts, bodies, n_rows, max_tokens, rounds, lone_rounds,
                       two_row_case, eos, greedy, key, settle_s, metrics_arm: bool = False) -> dict:
    """All arms on one event loop with one keep-alive HTTP client (like a real client); the
    in-process arms run in a worker thread. Arms alternate, with a short settle pause between
    them so one arm's spinning BLAS threads do not tax the next."""
    import httpx

    loop = asyncio.get_running_loop()
    med = statistics.median

    async def inproc(fn, *args):
        return await loop.run_in_executor(None, fn, *args)

    async def settle():
        await asyncio.sleep(settle_s)

    out: dict = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        # Warm both arms (lanes, compiled graphs, connections).
        for k in sorted({n_rows, 2, 1}):
            await inproc(_inproc_cohort, service, mtp_batch, prompts[:k], 16, eos, greedy, key)
            await _http_wave(client, bodies(k, 16), stream=True)
            if metrics_arm:
                await _http_wave(client, bodies(k, 16), stream=True, prefix=NO_METRICS_PREFIX)

        async def cohort_case(k, with_metrics_arm=False):
            inp, sse_, js, on, off = [], [], [], [], []
            same = True
            for rnd in range(rounds):
                if with_metrics_arm:
                    # the SSE wave with metrics on (and the live page polling) vs the copy without,
                    # first arm alternating by round
                    for arm in ((True, False) if rnd % 2 == 0 else (False, True)):
                        await settle()
                        w = await _http_wave(client, bodies(k, max_tokens), stream=True, watch_page=arm,
                                             prefix="" if arm else NO_METRICS_PREFIX)
                        (on if arm else off).append(w["tokens"] / w["wall_s"])
                await settle()
                a = await inproc(_inproc_cohort, service, mtp_batch, prompts[:k], max_tokens, eos, greedy, key)
                await settle()
                b = await _http_wave(client, bodies(k, max_tokens), stream=True)
                await settle()
                c = await _http_wave(client, bodies(k, max_tokens), stream=False)
                same &= a["tokens"] == b["tokens"] == c["tokens"]
                inp.append(a["tokens"] / a["wall_s"])
                sse_.append(b["tokens"] / b["wall_s"])
                js.append(c["tokens"] / c["wall_s"])
            metrics = None
            if with_metrics_arm:
                ratios = [a / b for a, b in zip(on, off)]
                metrics = {"on_tok_s": on, "off_tok_s": off, "on_off_ratios": ratios,
                           "on_off_ratio_median": med(ratios), "cost_pct": 100.0 * (1.0 - med(ratios))}
            return {"rows": k, "completion_tokens": a["tokens"], "same_token_counts": bool(same), "metrics": metrics,
                    "inproc_tok_s": inp, "http_stream_tok_s": sse_, "http_json_tok_s": js,
                    "inproc_tok_s_median": med(inp), "http_stream_tok_s_median": med(sse_),
                    "http_json_tok_s_median": med(js),
                    "ratio_stream": med(sse_) / med(inp), "ratio_json": med(js) / med(inp),
                    "http_ttft_s_median": med([r["ttft"] for r in b["rows"] if r["ttft"] is not None]),
                    "inproc_ttft_s_median": med(a["ttft"])}

        out["cohort"] = await cohort_case(n_rows, with_metrics_arm=metrics_arm)
        if two_row_case:
            out["two_rows"] = await cohort_case(2)

        # A lone request: time to first token, interleaved.
        lone_http, lone_submit, lone_cohort = [], [], []
        for _ in range(lone_rounds):
            await settle()
            lone_submit.append(await inproc(_inproc_lone_ttft, service, mtp_batch, prompts[0], 8, eos, greedy, key, True))
            await settle()
            lone_cohort.append(await inproc(_inproc_lone_ttft, service, mtp_batch, prompts[0], 8, eos, greedy, key, False))
            await settle()
            w = await _http_wave(client, bodies(1, 8), stream=True)
            lone_http.append(w["rows"][0]["ttft"])
        out["lone_ttft"] = {
            "http_s": lone_http, "inproc_submit_s": lone_submit, "inproc_submit_cohort_s": lone_cohort,
            "http_median_s": med(lone_http), "inproc_submit_median_s": med(lone_submit),
            "inproc_submit_cohort_median_s": med(lone_cohort),
            "overhead_ms_vs_submit": 1000 * (med(lone_http) - med(lone_submit)),
            "overhead_ms_vs_submit_cohort": 1000 * (med(lone_http) - med(lone_cohort)),
        }
    return out


def format_report(r: dict) -> str:
    """A few human-readable lines from a bench_http report."""
    lines = [f"mtplx bench http  model={r['model']}  blas={r['runtime'].get('blas')} "
             f"threads={r.get('blas_threads')}  max_tokens={r['max_tokens']}"]
    for label in ("cohort", "two_rows"):
        c = r.get(label)
        if not c:
            continue
        lines.append(f"  {c['rows']} rows x {r['max_tokens']}: in-process {c['inproc_tok_s_median']:.1f} tok/s | "
                     f"HTTP SSE {c['http_stream_tok_s_median']:.1f} ({c['ratio_stream']:.2f}x) | "
                     f"HTTP JSON {c['http_json_tok_s_median']:.1f} ({c['ratio_json']:.2f}x) | "
                     f"same tokens: {c['same_token_counts']}")
    m = (r.get("cohort") or {}).get("metrics")
    if m:
        lines.append(f"  metrics + live page on/off: {', '.join(f'{x:.3f}' for x in m['on_off_ratios'])}; "
                     f"median {m['on_off_ratio_median']:.3f} (cost {m['cost_pct']:.1f}%, target <= 2%)")
    t = r["lone_ttft"]
    lines.append(f"  lone TTFT: HTTP {1000 * t['http_median_s']:.1f} ms | in-process submit "
                 f"{1000 * t['inproc_submit_median_s']:.1f} ms (overhead {t['overhead_ms_vs_submit']:.1f} ms) | "
                 f"submit_cohort {1000 * t['inproc_submit_cohort_median_s']:.1f} ms "
                 f"(overhead {t['overhead_ms_vs_submit_cohort']:.1f} ms)")
    return "\n".join(lines)



def render_report(record: dict, image: str) -> str:
    """The `bench:http` section of BENCHMARKS.md (see benchmarks.report)."""
    from benchmarks.report import machine_line

    t = record["lone_ttft"]
    threads = record["blas_threads"]
    lines = ["## bench http: the Ray Serve path vs the in-process service", "",
             f"`{record['command']}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. Model: {record['model']}.",
             machine_line(record["machine"]), "",
             f"Greedy chat rows of {record['max_tokens']} tokens at most (eos stops them; both arms decode the same "
             "tokens): the in-process service's `submit_cohort` vs the same rows as concurrent",
             "`/v1/chat/completions` requests to the app on a Ray Serve the bench starts on loopback (streaming SSE,",
             "and plain JSON);",
             f"{record['rounds']} round(s), arms alternating with a {record['settle_s']:.1f} s pause between them; "
             f"tok/s from each arm's wall time, medians over rounds. BLAS threads: replica {threads['replica']}, "
             f"in-process {threads['in_process']}.",
             "",
             "| rows | in-process tok/s | HTTP SSE tok/s | SSE/in-process | HTTP JSON tok/s | JSON/in-process "
             "| TTFT in-process / SSE ms | same token counts |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for case in ("cohort", "two_rows"):
        c = record.get(case)
        if c:
            lines.append(f"| {c['rows']} | {c['inproc_tok_s_median']:.1f} | {c['http_stream_tok_s_median']:.1f} "
                         f"| {c['ratio_stream']:.2f} | {c['http_json_tok_s_median']:.1f} | {c['ratio_json']:.2f} "
                         f"| {1000 * c['inproc_ttft_s_median']:.0f} / {1000 * c['http_ttft_s_median']:.0f} "
                         f"| {'yes' if c['same_token_counts'] else '**no**'} |")
    m = (record.get("cohort") or {}).get("metrics")
    if m:
        lines += ["", f"What the metrics and the live page cost ({record['cohort']['rows']} rows, HTTP SSE, "
                  f"{len(m['on_off_ratios'])} rounds): the app with metrics on and its snapshot polled once a "
                  "second (as the live page does) against a copy of the app with `metrics: false` on the same "
                  "Serve, the first arm alternating by round: on/off "
                  + ", ".join(f"{x:.3f}" for x in m["on_off_ratios"])
                  + f"; median {m['on_off_ratio_median']:.3f}, a cost of {m['cost_pct']:.1f}% (target <= 2%)."]
    lines += ["",
              f"A lone request ({len(t['http_s'])} rounds, medians): time to first token through HTTP "
              f"{1000 * t['http_median_s']:.1f} ms, in-process `submit` (the service's own gather window) "
              f"{1000 * t['inproc_submit_median_s']:.1f} ms: {t['overhead_ms_vs_submit']:.1f} ms of HTTP overhead "
              f"(target <= 30); against `submit_cohort` (no window) {1000 * t['inproc_submit_cohort_median_s']:.1f} ms.",
              "", f"![bench http]({image})"]
    return "\n".join(lines) + "\n"


def plot_report(record: dict, path) -> None:
    """Aggregate tok/s per arm and row count; lone-request time to first token per arm."""
    from benchmarks.report import grouped_bars, pyplot, save_figure

    plt = pyplot()
    fig, (ax_tok, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    cases = [record[c] for c in ("cohort", "two_rows") if record.get(c)]
    grouped_bars(ax_tok, [f"{c['rows']} rows" for c in cases], {
        "in-process": [c["inproc_tok_s_median"] for c in cases],
        "HTTP SSE": [c["http_stream_tok_s_median"] for c in cases],
        "HTTP JSON": [c["http_json_tok_s_median"] for c in cases]}, "tok/s (all rows)", "aggregate throughput")
    t = record["lone_ttft"]
    grouped_bars(ax_ttft, ["lone request"], {
        "in-process submit_cohort": [1000 * t["inproc_submit_cohort_median_s"]],
        "in-process submit": [1000 * t["inproc_submit_median_s"]],
        "HTTP SSE": [1000 * t["http_median_s"]]}, "ms", "time to first token", digits=1)
    save_figure(fig, path, record)

def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--base-url", default=None)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lone-rounds", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-metrics-arm", action="store_true", help="skip the metrics on/off comparison")
    a = p.parse_args(argv)
    report = bench_http(model_path=a.model, n_rows=a.rows, max_tokens=a.max_tokens, rounds=a.rounds,
                        lone_rounds=a.lone_rounds, base_url=a.base_url, metrics_arm=not a.no_metrics_arm)
    print(json.dumps(report, default=str) if a.json else format_report(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
