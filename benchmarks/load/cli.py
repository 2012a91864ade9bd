"""`mtplx bench load` and `python -m benchmarks.load`: options to a plan, the run, its outputs."""

from __future__ import annotations

import json
from typing import Optional

from benchmarks.load.bench import bench_load
from benchmarks.load.outputs import write_outputs
from mtplx.api.rows import GENERATION_MODES
from benchmarks.load.workload import DEFAULT_CLIENTS, DEFAULT_TEMPERATURES, parse_temperatures


def run_cli(quick: bool = False, runs: int = 3, clients: Optional[str] = None, model: Optional[str] = None,
            json_out: bool = False, per_client: Optional[int] = None, open_requests: Optional[int] = None,
            modes: Optional[str] = None, logprobs: Optional[int] = None,
            temperatures: Optional[str] = None, direct_http: bool = False,
            long_prompt_tokens: Optional[int] = None, min_requests: Optional[int] = None,
            config: Optional[str] = None, generation_mode: Optional[str] = None) -> dict:
    """The `mtplx bench load` entry: `--quick` is 1 run, clients {1, 8}, greedy, few requests."""
    if quick:
        opts = dict(runs=1, clients=(1, 8), temperatures=(0.0,), per_client=2, min_requests=4, open_requests=16)
    else:
        opts = dict(runs=runs, clients=DEFAULT_CLIENTS, temperatures=DEFAULT_TEMPERATURES, per_client=6, min_requests=12,
                    open_requests=48)
    if clients:
        opts["clients"] = [int(c) for c in clients.split(",")]
    if per_client:
        opts["per_client"] = per_client
    if min_requests:
        opts["min_requests"] = min_requests
    if open_requests is not None:
        opts["open_requests"] = open_requests
    if temperatures:
        opts["temperatures"] = parse_temperatures(temperatures)
    if modes:
        opts["modes"] = [m.strip() for m in modes.split(",")]
    if logprobs is not None:
        opts["logprobs"] = logprobs
    record = bench_load(model_dir=model, direct_http=direct_http, long_prompt_tokens=long_prompt_tokens,
                        config=config, generation_mode=generation_mode, **opts)
    record["quick"] = quick
    command = "mtplx bench load" + (" --quick" if quick else f" --runs {opts['runs']}") + \
        (f" --clients {clients}" if clients else "") + (f" --temperatures {temperatures}" if temperatures else "") + \
        (f" --model {model}" if model else "") + (f" --config {config}" if config else "") + \
        (f" --generation-mode {generation_mode}" if generation_mode else "") + \
        (f" --requests-per-client {per_client}" if per_client else "") + \
        (f" --min-requests {min_requests}" if min_requests else "") + \
        (f" --open-requests {open_requests}" if open_requests is not None else "") + \
        (f" --modes {modes}" if modes else "") + (f" --logprobs {logprobs}" if logprobs is not None else "") + \
        (" --direct-http" if direct_http else "") + \
        (f" --long-prompt-tokens {long_prompt_tokens}" if long_prompt_tokens else "")
    out = write_outputs(record, command)
    if json_out:
        print(json.dumps(record, default=str), flush=True)
    else:
        print(out["table"])
        print(f"\nJSON: {out['json']}\nchart: {out['png']}\nsection: {out['markdown']}", flush=True)
    return record


def add_load_options(p) -> None:
    """The options only `bench load` takes, shared by `mtplx bench load` and `python -m
    benchmarks.load`."""
    p.add_argument("--temperatures", default=None,
                   help="comma-separated arms: temperatures (0 greedy) and `mixed`, the arm of per-request "
                        "temperature and top_p (default 0,0.6,mixed)")
    p.add_argument("--requests-per-client", type=int, default=None, help="closed-loop requests per client (6)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="closed-loop requests per arm at least, whatever the clients (12)")
    p.add_argument("--open-requests", type=int, default=None, help="requests in the open-loop arm (48; 0: none)")
    p.add_argument("--modes", default=None,
                   help="ours only: closed-loop arms twice per generation_mode (mirrored order; one client: "
                        "request by request), e.g. auto,mtp,ar")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="ours only: closed-loop arms without and with logprobs: K, alternated")
    p.add_argument("--config", default=None,
                   help="ours: the serve config to run (default serve_configs/config.yaml; --model still sets "
                        "its model_path)")
    p.add_argument("--generation-mode", default=None, choices=GENERATION_MODES,
                   help="ours: the app's default_generation_mode for every arm (the config's otherwise); "
                        "`ar`: our AR lanes against the peer")
    p.add_argument("--long-prompt-tokens", type=int, default=None, metavar="N",
                   help="also an arm of greedy requests one at a time with prompts of about N tokens "
                        "(time to first token on long prompts)")


def main(argv=None) -> int:
    import argparse

    import benchmarks.load

    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=benchmarks.load.__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 run, clients 1,8, greedy only, few requests")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", default=None, help="comma-separated closed-loop client counts (default 1,8,16,32)")
    p.add_argument("--model", default=None, help="checkpoint dir or installed model name for both servers (default: the shipped model)")
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the table")
    p.add_argument("--direct-http", action="store_true", help="ours: clients call the ingress replica on its own port")
    add_load_options(p)
    a = p.parse_args(argv)
    if a.temperatures:
        try:
            parse_temperatures(a.temperatures)
        except ValueError as exc:
            p.error(str(exc))
    run_cli(quick=a.quick, runs=a.runs, clients=a.clients, model=a.model, json_out=a.json,
            per_client=a.requests_per_client, open_requests=a.open_requests, modes=a.modes,
            logprobs=a.logprobs, temperatures=a.temperatures, direct_http=a.direct_http,
            long_prompt_tokens=a.long_prompt_tokens, min_requests=a.min_requests, config=a.config,
            generation_mode=a.generation_mode)
    return 0
