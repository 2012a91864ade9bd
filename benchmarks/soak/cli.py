"""`mtplx bench soak` and `python -m benchmarks.soak`: both phases, each on its own server, the
checks, the section of BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

from benchmarks.report import ROOT, replace_section
from benchmarks.servers import start_ours
from benchmarks.soak.clients import (CLIENTS, DROP_FRACTION, MAX_BUDGET, MIN_BUDGET, OVERLOAD_ARGS, OVERLOAD_CLIENTS,
                                     OVERLOAD_PROCESSES, OVERLOAD_S, REQUESTS, SAMPLED, WARMUP_PER_CLIENT,
                                     overload_processes, probe, soak, soak_plan, start_probe)
from benchmarks.soak.summary import (MEMORY_BOUND, REFUSAL_BOUND_S, STEADY_AFTER_S, MemorySampler, replica_memory,
                                     rss_trend, server_refusals, summarize_overload, summarize_probe, summarize_soak,
                                     wait_idle)
from mtplx.models.registry import check_installed
from mtplx.scheduler.config import IDLE_HEAP_RELEASE_S


def bench_soak(model_dir: Optional[str] = None, requests: int = REQUESTS, clients: int = CLIENTS,
               overload_clients: int = OVERLOAD_CLIENTS, overload_s: float = OVERLOAD_S,
               ready_timeout_s: float = 600.0, direct_http: bool = False,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    import mtplx

    started = time.time()
    model_path = Path(check_installed(model_dir)).resolve() if model_dir else None   # a directory or an installed name
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "build" / "bench"
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    record = {"bench": "soak", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "model": str(model_path) if model_path else "shipped",
              "plan": {"requests": requests, "clients": clients, "drop_fraction": DROP_FRACTION,
                       "direct_http": direct_http,
                       "budgets": [MIN_BUDGET, MAX_BUDGET], "sampled": SAMPLED,
                       "overload_clients": overload_clients, "overload_s": overload_s,
                       "overload_processes": OVERLOAD_PROCESSES,
                       "overload_args": OVERLOAD_ARGS, "refusal_bound_s": REFUSAL_BOUND_S},
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "runtime": mtplx.runtime_info()},
              "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}
    with tempfile.TemporaryDirectory(prefix="mtplx-bench-soak-") as tmp:
        work = Path(tmp)
        log(f"soak: {requests} streaming requests from {clients} clients ({DROP_FRACTION:.0%} dropped)")
        server = start_ours(model_path, out_dir / "logs" / f"soak-{stamp}-soak.log", work, ready_timeout_s,
                            direct_http=direct_http)
        try:
            model = server.model
            # warm-up (WARMUP_PER_CLIENT requests per client, same mix), so that memory is measured
            # after first-use costs: lane buffers at every width, allocator pools, caches
            asyncio.run(soak(server.url, soak_plan(clients * WARMUP_PER_CLIENT, seed=99), clients, model))
            idle0 = wait_idle(server.url)
            mem0 = replica_memory(idle0["snapshot"])
            with MemorySampler(server.url) as curve:
                rows, wall = asyncio.run(soak(server.url, soak_plan(requests), clients, model))
            idle = wait_idle(server.url)
            mem1 = replica_memory(idle["snapshot"])
            s = summarize_soak(rows, wall)
            s.update(idle_after=idle["state"], memory_before_mb=mem0, memory_after_mb=mem1,
                     rss_curve_mb=curve.samples, rss_trend=rss_trend(curve.samples),
                     ingress=(idle["snapshot"] or {}).get("ingress"))
            if mem0["rss"]:
                s["rss_growth"] = mem1["rss"] / mem0["rss"] - 1
                # what is not the bounded prefix cache filling up
                s["rss_growth_beside_prefix_bank"] = (mem1["rss"] - mem1["prefix_bank"]) / \
                    (mem0["rss"] - mem0["prefix_bank"]) - 1
            record["soak"] = s
            log(f"soak: {s['outcomes']} in {s['wall_s']} s, lost {s['lost']}, 5xx {s['status_5xx']}, "
                f"idle {s['idle_after']}, memory {mem0} -> {mem1} MB")
        finally:
            record["soak_stop"] = server.stop()
        log(f"overload: {overload_clients} clients for {overload_s:.0f} s against a small queue {OVERLOAD_ARGS}")
        server = start_ours(model_path, out_dir / "logs" / f"soak-{stamp}-overload.log", work, ready_timeout_s,
                            args_overrides=OVERLOAD_ARGS, direct_http=direct_http)
        try:
            # a probe in its own process, after the clients have filled the queues
            prober = start_probe(server.url, max(5.0, overload_s - 10.0), server.model)
            rows, wall = overload_processes(server.url, overload_clients, overload_s, server.model)
            probe_rows = json.loads(prober.communicate(timeout=120)[0] or "[]")
            idle = wait_idle(server.url)
            o = summarize_overload(rows, wall)
            o["idle_after"] = idle["state"]
            o["probe"] = summarize_probe(probe_rows)
            o["front"] = server_refusals(server.cleanup_dir, direct_http)
            record["overload"] = o
            log(f"overload: {o['refused']} refused ({o['refused_statuses']}, p50 {o['refusal_p50_ms']} ms, "
                f"p99 {o['refusal_p99_ms']} ms), {o['admitted_completed']}/{o['admitted']} admitted completed")
        finally:
            record["overload_stop"] = server.stop()
    s, o = record["soak"], record["overload"]
    record["checks"] = {
        "soak_none_lost": s["lost"] == 0,
        "soak_no_5xx": s["status_5xx"] == 0,
        "soak_nothing_left": all(not v for v in s["idle_after"].values()),
        "soak_memory_within_10pct": (s.get("rss_growth_beside_prefix_bank") is not None
                                     and s["rss_growth_beside_prefix_bank"] <= MEMORY_BOUND),
        "overload_refusals_shaped": o["refused"] > 0 and o["refused_openai_shape_with_retry_after"] == o["refused"],
        "overload_refusals_within_100ms": o["refused"] > 0 and o["refused_within_bound"] == o["refused"],
        "overload_refusal_p99_within_100ms_after_10s": (o.get("steady_refusal_p99_ms") is not None
                                                       and o["steady_refusal_p99_ms"] <= REFUSAL_BOUND_S * 1000),
        "overload_probe_refusal_p50_within_100ms": (o["probe"]["refusal_p50_ms"] is not None
                                                    and o["probe"]["refusal_p50_ms"] <= REFUSAL_BOUND_S * 1000),
        "overload_admitted_all_complete": o["admitted_completed"] == o["admitted"],
    }
    record["elapsed_s"] = time.time() - started
    record["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    record["artifacts"] = {"json": str(out_dir / f"soak-{stamp}.json")}
    return record


def render_section(record: dict, command: str) -> str:
    m, rt, s, o = record["machine"], record["machine"]["runtime"], record["soak"], record["overload"]
    p = record["plan"]
    mb0, mb1 = s["memory_before_mb"], s["memory_after_mb"]
    quick = " (quick smoke run: not the full workload)" if record.get("quick") else ""
    ok = lambda b: "yes" if b else "**no**"   # noqa: E731
    c = record["checks"]
    lines = [
        f"## bench soak{' (direct HTTP)' if p.get('direct_http') else ''}: churn and overload{quick}",
        "",
        f"`{command}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. Machine: `{m['platform']}`, "
        f"{m['cpu_count']} CPUs, BLAS {rt.get('blas')}, mlx {rt.get('mlx_version')} on `{rt.get('mlx_device')}`. "
        f"Model: {record['model']}. Each phase on its own `serve run serve_configs/config.yaml`"
        + (", clients on the ingress replica's own port (`--direct-http`: Serve's direct ingress, no proxy "
           "hop)" if p.get("direct_http") else "") + ". "
        f"Load average (1/5/15 min) at start {_load(record.get('loadavg_start'))}, at end "
        f"{_load(record.get('loadavg_end'))}: the CPUs are shared with the bench client and other work.",
        "",
        f"**Soak**: {p['requests']} streaming `/v1/completions` from {p['clients']} closed-loop clients, greedy and "
        f"sampled (t {SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, top_k {SAMPLED['top_k']}) alternating, "
        f"`max_tokens` {p['budgets'][0]}-{p['budgets'][1]}, {p['drop_fraction']:.0%} of streams dropped mid-way "
        "(the client closes after about a third of its budget). Lost: a kept request that did not end with "
        f"`[DONE]`. Memory: the replica's resident set after a {p['clients'] * WARMUP_PER_CLIENT}-request warm-up "
        f"(same mix) vs after the run, each read once the replica has been idle {2 * IDLE_HEAP_RELEASE_S:g} s "
        "(an idle replica hands its free heap back to the OS); under load it is higher: sampled every 15 s "
        "(`rss_curve_mb` in the JSON), its range is in the last column. The "
        "prompt-prefix bank is a bounded LRU cache (512 MiB budget) that fills by design, so the check is "
        "on the growth beside it.",
        "",
        "| requests | done | dropped | clean error events | lost | 5xx | 429/503 | completion tok/s | TTFT p50 / p99 ms "
        "| E2E p50 / p99 s | left in queues/maps | replica RSS MB before -> after | of which prefix bank MB "
        "| RSS under load MB (min-max); peak, 2nd half vs 1st half |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        f"| {s['requests']} | {s['outcomes'].get('done', 0)} | {s['dropped']} | {s['error_events']} | {s['lost']} | "
        f"{s['status_5xx']} | {s['refused']} | {s['tok_s_done']} | {s['ttft_p50_ms']} / {s['ttft_p99_ms']} | "
        f"{_fmt(s['e2e_p50_s'])} / {_fmt(s['e2e_p99_s'])} | "
        f"{'none' if all(not v for v in s['idle_after'].values()) else s['idle_after']} | "
        f"{mb0['rss']} -> {mb1['rss']} ({_pct(s.get('rss_growth'))}; {_pct(s.get('rss_growth_beside_prefix_bank'))} "
        f"beside the prefix bank) | {mb0['prefix_bank']} -> {mb1['prefix_bank']} | {_rss_range(s.get('rss_curve_mb'))}; "
        f"{_pct(s.get('rss_trend'))} |",
        "",
        f"**Overload**: {p['overload_clients']} closed-loop streaming clients for {p['overload_s']:.0f} s against a "
        f"small queue (app args {json.dumps(p['overload_args'])}); a refused client waits its `Retry-After`. "
        f"Refusal time: request sent to status line, as the clients see it ({p.get('overload_processes', 1)} "
        "processes sharing them, an event loop each with a plain HTTP/1.1 client, on the same CPUs as the server), as a probe "
        "sees it (a separate process sending one non-streaming request at a time while the clients keep the queues full), and as the server's HTTP front logged it (Serve's proxy, or "
        "with direct HTTP the ingress replica, whose access log the shipped config turns off: arrival there to its response, no client on the path). The "
        "opening seconds are a burst (every client "
        f"sends at once, and comes back after its `Retry-After`); refusals of requests sent after the first "
        f"{STEADY_AFTER_S:g} s are also given apart.",
        "",
        "| requests | admitted | admitted completed | refused | refused statuses | OpenAI shape + Retry-After "
        "| refusal p50 / p99 / max ms | within 100 ms "
        f"| after the first {STEADY_AFTER_S:g} s: refused, p50 / p99 ms, within 100 ms "
        "| probe: refused, p50 / p99 ms, within 100 ms "
        "| at the server's HTTP front: p50 / p99 ms, within 100 ms | admitted TTFT p50 ms | tok/s |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {o['requests']} | {o['admitted']} | {o['admitted_completed']} | {o['refused']} | {o['refused_statuses']} | "
        f"{o['refused_openai_shape_with_retry_after']} | {o['refusal_p50_ms']} / {o['refusal_p99_ms']} / "
        f"{o['refusal_max_ms']} | {o['refused_within_bound']}/{o['refused']} | {_steady(o)} | {_probe(o.get('probe'))} | {_front(o.get('front'))} | "
        f"{o['admitted_ttft_p50_ms']} | "
        f"{o['tok_s']} |",
        "",
        "Checks: " + ", ".join(f"{k.replace('_', ' ')}: {ok(v)}" for k, v in c.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def _steady(o: dict) -> str:
    if o.get("steady_refused") is None:
        return "-"
    return (f"{o['steady_refused']}, {o['steady_refusal_p50_ms']} / {o['steady_refusal_p99_ms']}, "
            f"{o['steady_refused_within_bound']}/{o['steady_refused']}")


def _rss_range(curve: Optional[List[list]]) -> str:
    mbs = [mb for _t, mb in curve or []]
    return f"{min(mbs):.0f}-{max(mbs):.0f}" if mbs else "-"


def _probe(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return (f"{p['refused']}/{p['requests']}, {p['refusal_p50_ms']} / {p['refusal_p99_ms']}, "
            f"{p['refused_within_bound']}/{p['refused']}")


def _front(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return f"{p['refusal_p50_ms']} / {p['refusal_p99_ms']}, {p['refused_within_bound']}/{p['refused']}"


def _load(v) -> str:
    return "-" if not v else "/".join(f"{x:.1f}" for x in v)


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.1%}"


def write_outputs(record: dict, command: str) -> dict:
    """The JSON under build/bench/ and the `soak` section of BENCHMARKS.md (`soak-direct` for a
    `--direct-http` run)."""
    name = "soak-direct" if record["plan"].get("direct_http") else "soak"
    md = ROOT / "BENCHMARKS.md"
    md.write_text(replace_section(md.read_text() if md.exists() else "", name, render_section(record, command)))
    Path(record["artifacts"]["json"]).write_text(json.dumps(record, indent=2, default=str))
    record["artifacts"]["markdown"] = str(md)
    return record["artifacts"]


def run_cli(quick: bool = False, model: Optional[str] = None, json_out: bool = False,
            direct_http: bool = False) -> dict:
    """The `mtplx bench soak` entry: `--quick` is 100 requests and 15 s of overload."""
    opts = dict(requests=100, overload_s=15.0) if quick else {}
    record = bench_soak(model_dir=model, direct_http=direct_http, **opts)
    record["quick"] = quick
    command = "mtplx bench soak" + (" --quick" if quick else "") + (f" --model {model}" if model else "") + \
        (" --direct-http" if direct_http else "")
    out = write_outputs(record, command)
    if json_out:
        print(json.dumps(record, default=str), flush=True)
    else:
        print(json.dumps(record["checks"], indent=2))
        print(f"\nJSON: {out['json']}\nsection: {out['markdown']}", flush=True)
    return record


def main(argv=None) -> int:
    import argparse

    import benchmarks.soak

    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=benchmarks.soak.__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="100 requests, 15 s of overload")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    p.add_argument("--json", action="store_true", help="print the JSON record")
    p.add_argument("--direct-http", action="store_true", help="clients call the ingress replica on its own port")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)          # internal: the refusal probe
    p.add_argument("--probe-seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--probe-model", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(a.probe, a.probe_seconds, a.probe_model)), flush=True)
        return 0
    record = run_cli(quick=a.quick, model=a.model, json_out=a.json, direct_http=a.direct_http)
    return 0 if all(record["checks"].values()) else 1
