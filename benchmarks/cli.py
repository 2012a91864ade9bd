"""`mtplx bench ...` (`python -m benchmarks ...`): the benchmarks' command line; the library's own
`mtplx` runs it as a program, never importing it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(a) -> None:
    """`mtplx bench WHAT`: run one benchmark, write its report section, print its record."""
    import mtplx
    from benchmarks import lane as bench
    from benchmarks.report import machine_info, new_record, write_report

    if a.what == "load":
        from benchmarks.load import run_cli

        run_cli(quick=a.quick, runs=a.runs, clients=a.clients, model=a.model, json_out=a.json, modes=a.modes,
                logprobs=a.logprobs, temperatures=a.temperatures, per_client=a.requests_per_client,
                open_requests=a.open_requests, direct_http=a.direct_http, long_prompt_tokens=a.long_prompt_tokens,
                min_requests=a.min_requests, config=a.config, generation_mode=a.generation_mode)
        return
    if a.what == "structured":
        from benchmarks.structured import run_cli as run_structured

        if run_structured(a):
            sys.exit(1)
        return
    if a.what == "sessions":
        from benchmarks.sessions import run_cli as run_sessions

        record = run_sessions(runs=a.runs, quick=a.quick, json_out=a.json, no_report=a.no_report,
                              command=a.command_line)
        if any(s["errors"] for s in record["summary"].values()) or (record.get("kill") or {}).get("problems"):
            sys.exit(1)
        return
    if a.what == "exactness":
        from benchmarks.exactness import bench_exactness, render

        result = bench_exactness(a.model, a.prompts, a.tokens or 64)
        print(json.dumps(result) if a.json else render(result))
        return
    if a.what == "soak":
        from benchmarks.soak import run_cli as run_soak

        record = run_soak(quick=a.quick, model=a.model, json_out=a.json, direct_http=a.direct_http)
        if not all(record["checks"].values()):
            sys.exit(1)
        return
    machine, started = machine_info(), time.time()
    if a.what == "http":
        from benchmarks import http as bench_http

        result = bench_http.bench_http(model_path=a.model, n_rows=a.prompts, max_tokens=a.tokens or 256,
                                       rounds=a.rounds)
        render, plot = bench_http.render_report, bench_http.plot_report
        options = {"rows": a.prompts, "tokens": a.tokens or 256, "rounds": a.rounds}
    else:
        model = mtplx.load_model(a.model)
        if a.what == "solo":
            options = {"prompts": a.prompts, "tokens": a.tokens or 128, "rounds": a.rounds}
            result = bench.bench_solo(model, tokens=options["tokens"], n_prompts=a.prompts, rounds=a.rounds,
                                      blas_off_child=not a.no_child)
            render, plot = bench.render_solo, bench.plot_solo
        elif a.what == "profile":
            from benchmarks.forward_profile import bench_profile, plot_profile, render_profile
            from mtplx.runtime import set_blas_threads

            options = {"rounds": a.rounds, "blas_threads": set_blas_threads(a.blas_threads)}
            result = bench_profile(model, rounds=a.rounds)
            render, plot = render_profile, plot_profile
        elif a.what == "lane":
            options = {"tokens": a.tokens or 256, "rounds": a.rounds}
            result = bench.bench_lane(model, tokens=options["tokens"], rounds=a.rounds)
            render, plot = bench.render_lane, bench.plot_lane
        else:
            from benchmarks.service import bench_service_overhead

            budgets = {"min_tokens": a.tokens // 2, "max_tokens": a.tokens} if a.tokens else {}
            options = {"prompts": a.prompts, "rounds": a.rounds, **budgets}
            result = bench_service_overhead(model, n_prompts=a.prompts, rounds=a.rounds, **budgets)
            render, plot = bench.render_service, bench.plot_service
    record = new_record(a.what, result, a.command_line, a.model or "shipped", options, machine,
                        time.time() - started)
    if not a.no_report:
        # a run on another checkpoint gets a section of its own: bench:lane-qwen3_5_moe-bf16-v248320
        section = f"{a.what}-{Path(a.model).name}" if a.model else None
        artifacts = write_report(record, render, plot, name=section)
        print(f"JSON: {artifacts['json']}\nchart: {artifacts['png']}\nsection: {artifacts['markdown']}",
              file=sys.stderr, flush=True)
    print(json.dumps(record, default=str) if a.json else json.dumps(record, indent=2, default=str))


def add_structured_options(p) -> None:
    """The options only `bench structured` takes."""
    p.add_argument("--duration", type=float, default=None, help="seconds per arm (20; --quick: 4)")
    p.add_argument("--served", action="store_true", help="also through `serve run` (response_format json_schema), "
                                                         "closed loops of --clients clients")
    p.add_argument("--served-only", action="store_true", help="only the served arms")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="served: /v1/completions (code prompts, the default) or /v1/chat/completions")
    p.add_argument("--blas-threads", type=int, default=1, help="in process (structured, profile): BLAS threads (1, as a replica)")


def parser():
    """`mtplx bench`'s options (`python -m benchmarks` takes the same)."""
    import argparse

    from benchmarks.load.cli import add_load_options

    b = argparse.ArgumentParser(prog="mtplx bench", description=__doc__.splitlines()[0])
    b.add_argument("what", choices=("solo", "lane", "service", "http", "load", "soak", "structured", "exactness",
                                    "sessions", "profile"))
    b.add_argument("--model", default=None)
    b.add_argument("--tokens", type=int, default=None, help="tokens a row (structured: max_tokens, 96)")
    b.add_argument("--prompts", type=int, default=8, help="solo, exactness: prompts; service, http: rows of the "
                                                          "cohort")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--json", action="store_true", help="one JSON line")
    b.add_argument("--no-child", action="store_true", help="skip the BLAS-off child run")
    b.add_argument("--no-report", action="store_true",
                   help="solo/lane/service/http/structured: print only; no JSON record, chart or "
                        "BENCHMARKS.md section")
    b.add_argument("--quick", action="store_true", help="load: 1 run, clients 1,8, greedy only, few requests; "
                                                        "soak: 100 requests, 15 s of overload; "
                                                        "structured: 1 round of 4 s per arm; "
                                                        "sessions: 1 run, power_of_two and affinity only")
    b.add_argument("--runs", type=int, default=3, help="load: runs per server, turns interleaved; sessions: runs "
                                                       "of every arm, rotated")
    b.add_argument("--clients", default=None, help="load: closed-loop client counts, e.g. 1,8,16,32; "
                                                   "structured --served: 1,8")
    b.add_argument("--direct-http", action="store_true", help="load, soak: clients call the ingress replica on its "
                                                              "own port (Serve's direct ingress), not the proxy")
    add_load_options(b.add_argument_group("load only"))
    add_structured_options(b.add_argument_group("structured only"))
    return b


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    a.command_line = " ".join(["mtplx", "bench", *argv])
    run(a)
    return 0
