"""`bench structured`: what structured output costs (rows that must follow a JSON schema,
`mtplx.structured`) against the same rows free, and whether what the constrained rows return
validates (issue 43's targets: constrained/unconstrained tok/s >= 0.85, 100% of completed
constrained outputs valid).

Workload: `benchmarks.schemas` (28 schemas, each with a chat-less prompt for the tiny Python-code
model); request i takes schema i mod 28. Arms: constrained (every row has its schema) and
unconstrained (the same prompts, no constraint), both with `max_tokens` 96 and the end-of-sequence
tokens as stops, under two samplers: greedy, and temperature 0.6 with top_p 0.95 (top_k 20, MTPLX's
default; sampled rows carry seed i, the same in both arms).

In process (`bench_structured_lane`): the lanes a replica installs, built the way it builds them
(`LaneLadder` with greedy depths chosen by measured cost and sampled rows chaining
`DEFAULT_SAMPLED_DEPTH` drafts, the B8 lane self-checked) and the `RunningLane` the service starts
for a key (`_start_lane`: the ladder, its greedy ladder and its sampled ladder), with rows as the
service makes them for `generation_mode` auto (`adaptive`); BLAS threads 1, as a replica sets them.
No service thread and no HTTP: the engine the replica runs, driven directly. Only the B8 lane (and
the solo lane a ladder starts from) is installed: 8 rows are live from the first step to the last,
which is the width the app's lane takes for 8 rows. Closed loop: 8 rows live, each row that ends is
replaced at once by the next request, for `duration_s` of wall time per arm; tok/s is every token
the rows returned in that time (stop tokens not counted; prefills of new rows inside the time) over
the wall time. Per arm also the lane's draft acceptance (accepted / (accepted + rejected) drafts),
rows per cycle, ms per step, and the ended rows: mean tokens, how many ended "stop" (judged: JSON
validating against the schema, formats checked, numbers as decimals), "length" (incomplete: not
judged, counted).

Served (`bench_structured_served`, `--served`, with its matched arm too: each free request's
`max_tokens` its schema's median constrained completion so far): our app started as `bench load`
starts it (`serve run` of serve_configs/config.yaml, or `--config`, on a free port), closed loops of 1 and 8 clients for `duration_s`
each (requests still in flight at the end are awaited and counted; the wall time includes them, so
the longer unconstrained rows pay a slightly longer tail: small against 20 s arms), non-streaming
`/v1/completions` with `response_format` json_schema (strict) against the same requests without it;
tok/s = usage completion tokens / wall; acceptance and rows per cycle from the replicas' snapshot
around each arm. The prompts come back every 28 requests, so the replica's prefix bank may serve
their prefills (in both arms alike; in process every prefill runs). Completions, not chat: the tiny model is a code model and the prompts are code; in
process, the same prompts wrapped in its chat template (what /v1/chat/completions would decode) gave
the same picture (4 s arms, twice each: constrained acceptance 0.77 chat / 0.79 raw greedy, 0.85 /
0.84 sampled; tok/s within the noise), so `--endpoint chat` is there but not the default. It needs
the server's structured output: a server that refuses `response_format` stops the served part with
a message saying so (the in-process part's report is still written; the command exits 1).

Both parts warm up first (each sampler and arm for a few seconds, not measured): the first
grammars, spans and traces.

Rounds: per round, each sampler's (and served, each client count's) two arms run one after the
other, the constrained arm first in every other turn (and round), so that each goes first as often.
Figures are medians over rounds; the ratio is the median of the per-round ratios; counts of ended
rows are pooled over rounds.

    mtplx bench structured --quick             # smoke: 1 round of 4 s per arm, in process
    mtplx bench structured --rounds 3          # in process, 20 s per arm
    mtplx bench structured --rounds 3 --served # and through the server, 1 and 8 clients
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from benchmarks.report import grouped_bars, machine_line, pyplot, save_figure
from benchmarks.schemas import SCHEMAS, format_checker, validation_error

MAX_TOKENS = 96
WIDTH = 8
ARMS = ("constrained", "unconstrained")
# in process also: the same rows free, each with its constrained twin's length as its budget (the
# median tokens its item's constrained rows returned so far), so that both arms run as many rows,
# prefills and tokens a row: what remains between them is the grammar's own cost and acceptance
MATCHED = "matched"
ALL_ARMS = ARMS + (MATCHED,)
SAMPLERS = {"greedy": {"temperature": 0.0}, "t0.6": {"temperature": 0.6, "top_p": 0.95}}
TARGET_RATIO = 0.85
TARGET_VALIDITY = 1.0
DURATION_S, QUICK_DURATION_S = 20.0, 4.0
SERVED_CLIENTS = (1, 8)
INVALID_EXAMPLES = 3
LOG = lambda s: print(s, file=sys.stderr, flush=True)   # noqa: E731


def arm_order(round_index: int, turn: int) -> tuple:
    """The two arms in the order they run at this turn of this round: constrained first when
    round + turn is even, so each arm goes first as often (and in each round, at alternate turns)."""
    return ARMS if (round_index + turn) % 2 == 0 else ARMS[::-1]


# -- judging what rows return (pure) --------------------------------------------------------------

def new_tally() -> dict:
    return {"rows": 0, "row_tokens": 0, "stop": 0, "length": 0, "other": 0, "valid": 0, "invalid": 0,
            "invalid_examples": []}


def judge(tally: dict, item: dict, text: str, finish: Optional[str], n_tokens: int, checker=None) -> None:
    """Count one ended row: its tokens and finish reason; a row that ended "stop" is valid when its
    text is JSON matching its item's schema (the unconstrained arm is judged too: how often free
    text happens to validate)."""
    tally["rows"] += 1
    tally["row_tokens"] += int(n_tokens)
    if finish not in ("stop", "length"):
        tally["other"] += 1
        return
    tally[finish] += 1
    if finish != "stop":
        return
    error = validation_error(text, item["schema"], checker)
    if error is None:
        tally["valid"] += 1
        return
    tally["invalid"] += 1
    if len(tally["invalid_examples"]) < INVALID_EXAMPLES:
        tally["invalid_examples"].append({"schema": item["name"], "error": error, "text": text[:160]})


def _median(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summarize_arms(rounds: List[dict]) -> dict:
    """Per round {arm: run} (each run: tok_s, the tally, errors, and where known acceptance,
    rows_per_cycle, tokens_per_cycle, ms_per_step, host_ms_per_step, prefill_share) -> per arm the
    medians over rounds and the pooled counts, the median of the per-round ratios
    constrained/unconstrained tok/s, and whether the targets are met."""
    out: dict = {}
    for arm in [a for a in ALL_ARMS if any(a in r for r in rounds)]:
        runs = [r[arm] for r in rounds if arm in r]
        pooled = {k: sum(run.get(k, 0) for run in runs) for k in ("rows", "row_tokens", "stop", "length", "other",
                                                                    "valid", "invalid", "errors")}
        judged = pooled["valid"] + pooled["invalid"]
        out[arm] = {
            "tok_s": _median(run.get("tok_s") for run in runs),
            "acceptance": _median(run.get("acceptance") for run in runs),
            **{k: _median(run.get(k) for run in runs) for k in ("rows_per_cycle", "tokens_per_cycle", "ms_per_step",
                                                               "host_ms_per_step", "prefill_share")},
            **pooled,
            "mean_tokens_per_row": pooled["row_tokens"] / pooled["rows"] if pooled["rows"] else None,
            "validity": pooled["valid"] / judged if judged else None,
            "invalid_examples": [e for run in runs for e in run.get("invalid_examples", [])][:INVALID_EXAMPLES],
        }
    per_round = [_ratio(r.get("constrained", {}).get("tok_s"), r.get("unconstrained", {}).get("tok_s"))
                 for r in rounds]
    out["ratio_per_round"] = [None if x is None else round(x, 4) for x in per_round]
    out["ratio"] = _median(per_round)
    if MATCHED in out:
        matched = [_ratio(r.get("constrained", {}).get("tok_s"), r.get(MATCHED, {}).get("tok_s")) for r in rounds]
        out["ratio_matched_per_round"] = [None if x is None else round(x, 4) for x in matched]
        out["ratio_matched"] = _median(matched)
    validity = out["constrained"]["validity"]
    out["targets"] = {"ratio": out["ratio"] is not None and out["ratio"] >= TARGET_RATIO,
                      "validity": validity is not None and validity >= TARGET_VALIDITY
                      and out["constrained"]["errors"] == 0}
    return out


# -- in process: the running lane -------------------------------------------------------------------

def install_ladder(model, width: int = WIDTH):
    """The lanes a replica installs, as it installs them, at this one width (see the docstring)."""
    from mtplx.scheduler.config import DEFAULT_SAMPLED_DEPTH, GREEDY_DEPTHS_BY_COST
    from mtplx.scheduler.ladder import LaneLadder

    ladder = LaneLadder(model, greedy_depths=GREEDY_DEPTHS_BY_COST, sampled_depth=DEFAULT_SAMPLED_DEPTH)
    ladder.install([width])
    if width not in ladder.lanes:
        raise RuntimeError(f"the B{width} lane refused to install: {ladder.refused_widths.get(width)}")
    return ladder


def running_lane(ladder):
    """A key's running lane as the service starts it (`MTPBatchGenerationService._start_lane`)."""
    from mtplx.engine.lane import RunningLane

    return RunningLane(ladder.ladder(), greedy_ladder=ladder.greedy_ladder(),
                       sampled_ladder=ladder.ladder(ladder.sampled_depth))


def prepared_items(model, schemas: Iterable[dict] = SCHEMAS) -> list:
    """Each schema with its prompt's ids and its constraint, checked against the model's tokenizer
    as the ingress checks it (a schema that does not compile fails here, by name)."""
    from mtplx.structured import Constraint, check_constraint, grammar_tokenizer, json_schema_grammar

    tokenizer = grammar_tokenizer(model.tokenizer, model.vocab_size)
    items = []
    for s in schemas:
        constraint = Constraint(json_schema_grammar(s["schema"]), "json_schema")
        check_constraint(constraint, tokenizer, where=s["name"], schema=s["schema"])
        items.append({**s, "ids": tuple(model.tokenizer.encode(s["prompt"])), "constraint": constraint})
    return items


def _lane_request(model, item: dict, index: int, sampler, constrained: bool, max_tokens: int):
    from mtplx.engine.row import A3BMTPBatchRequest

    return A3BMTPBatchRequest(request_id=f"r{index}", prompt_ids=item["ids"], sampler=sampler, seed=index,
                              max_tokens=max_tokens, stop_token_ids=frozenset(model.eos_token_ids), adaptive=True,
                              constraint=item["constraint"] if constrained else None)


def lane_run(ladder, model, items: list, sampler, constrained: bool, duration_s: float,
             max_tokens: int = MAX_TOKENS, width: int = WIDTH, checker=None, budgets: Optional[dict] = None) -> dict:
    """One arm: `width` rows live in a fresh running lane for `duration_s`, each ended row replaced
    by the next request; what the rows returned, judged, and the lane's counters. `budgets`: an
    item's max_tokens by its name (the matched arm); `lengths` in the result: each item's rows'
    token counts."""
    running = running_lane(ladder)
    eos = frozenset(model.eos_token_ids)
    tally, item_of, counter = new_tally(), {}, itertools.count()

    def submit():
        i = next(counter)
        item = item_of[f"r{i}"] = items[i % len(items)]
        budget = (budgets or {}).get(item["name"], max_tokens)
        running.add(_lane_request(model, item, i, sampler, constrained, budget))

    for _ in range(width):
        submit()
    tokens = errors = 0
    lengths: dict = {}
    ended: list = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    while time.perf_counter() < deadline:
        for ev in running.step():
            tokens += sum(1 for t in ev.tokens if t not in eos)
            if ev.finish_reason is None:
                continue
            if ev.result is None:
                errors += 1
            else:
                ended.append((item_of[ev.request_id], list(ev.result.tokens), ev.finish_reason))
            submit()
    wall = time.perf_counter() - t0
    for item, toks, finish in ended:     # judged after the clock: validation is the benchmark's, not the engine's
        lengths.setdefault(item["name"], []).append(len(toks))
        judge(tally, item, model.tokenizer.decode(toks), finish, len(toks), checker)
    running.cancel_all()
    drafts = running.counters.accepted + running.counters.rejected
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "errors": errors, **tally,
            "acceptance": running.counters.accepted / drafts if drafts else None,
            "accepted": running.counters.accepted, "rejected": running.counters.rejected, "cycles": running.counters.cycles,
            "mtp_cycles": running.counters.mtp_cycles, "ar_steps": running.counters.ar_steps,
            "rows_per_cycle": running.counters.row_cycles / running.counters.cycles if running.counters.cycles else None,
            "tokens_per_cycle": tokens / running.counters.cycles if running.counters.cycles else None,
            "ms_per_step": running.counters.cycle_s / running.counters.cycles * 1e3 if running.counters.cycles else None,
            "host_ms_per_step": running.stats().host_s / running.counters.cycles * 1e3 if running.counters.cycles else None,
            "prefill_s": running.counters.prefill_s, "prefill_share": running.counters.prefill_s / wall, "lengths": lengths}


def matched_budgets(lengths: dict) -> dict:
    """Each item's budget for the matched arm: the median tokens its constrained rows returned."""
    return {name: max(1, int(round(statistics.median(ns)))) for name, ns in lengths.items() if ns}


def _pool(into: dict, lengths: dict) -> None:
    for name, ns in lengths.items():
        into.setdefault(name, []).extend(ns)


def sampler_configs() -> dict:
    from mtplx.sampling import SamplerConfig

    return {name: SamplerConfig(**kw) for name, kw in SAMPLERS.items()}


def bench_structured_lane(model, rounds: int = 3, duration_s: float = DURATION_S, max_tokens: int = MAX_TOKENS,
                          width: int = WIDTH, blas_threads: Optional[int] = 1, warmup_s: float = 2.0,
                          log: Callable[[str], None] = LOG) -> dict:
    """The in-process arms (see the module docstring); returns `lane` (per sampler, the summary),
    `per_round_lane` (every run) and `lane_setup`."""
    from mtplx.engine.settings import EngineSettings
    from mtplx.runtime import set_blas_threads

    threads = set_blas_threads(blas_threads) if blas_threads else set_blas_threads()
    t = time.perf_counter()
    ladder = install_ladder(model, width)
    install_s = time.perf_counter() - t
    items, samplers, checker = prepared_items(model), sampler_configs(), format_checker()
    log(f"structured: B{width} ladder installed in {install_s:.1f} s (greedy depths {ladder.greedy_depths}, "
        f"sampled depth {ladder.sampled_depth}); BLAS threads {threads}")
    lengths: dict = {name: {} for name in samplers}     # constrained rows' lengths per sampler and item
    for name, sampler in samplers.items():   # first traces, masks and spans: not measured
        for arm in ARMS:
            run = lane_run(ladder, model, items, sampler, arm == "constrained", warmup_s, max_tokens, width, checker)
            if arm == "constrained":
                _pool(lengths[name], run["lengths"])
    per_round = []
    for r in range(rounds):
        rnd: dict = {}
        for turn, (name, sampler) in enumerate(samplers.items()):
            rnd[name] = {}
            for arm in arm_order(r, turn) + (MATCHED,):
                run = lane_run(ladder, model, items, sampler, arm == "constrained", duration_s, max_tokens, width,
                               checker, budgets=matched_budgets(lengths[name]) if arm == MATCHED else None)
                if arm == "constrained":
                    _pool(lengths[name], run["lengths"])
                rnd[name][arm] = run
                log(f"structured round {r + 1}/{rounds} {name} {arm}: {run['tok_s']:.1f} tok/s, "
                    f"{run['rows']} rows ended ({run['stop']} stop, {run['length']} length, {run['valid']} valid), "
                    f"acceptance {run['acceptance'] or 0:.3f}")
        per_round.append(rnd)
    return {"lane": {name: summarize_arms([rnd[name] for rnd in per_round]) for name in samplers},
            "per_round_lane": per_round,
            "lane_setup": {"width": width, "duration_s": duration_s, "max_tokens": max_tokens, "rounds": rounds,
                           "blas_threads": threads,
                           "greedy_depths": {str(w): d for w, d in ladder.greedy_depths.items()},
                           "sampled_depth": ladder.sampled_depth, "draft_draw": EngineSettings().draft_draw,
                           "install_s": round(install_s, 2), "schemas": len(items)}}


# -- served: our app over HTTP ----------------------------------------------------------------------

class ResponseFormatRefused(RuntimeError):
    """The server does not do structured output (yet): `response_format` json_schema refused."""


def response_format(item: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True}}


def request_body(item: dict, index: int, sampler: str, constrained: bool, endpoint: str = "completions",
                 max_tokens: int = MAX_TOKENS, model: str = "") -> dict:
    """One request of an arm: the item's prompt (a completion prompt, or one user message for
    `chat`), the sampler's settings (sampled: seed = index), with or without its response_format."""
    body: dict = {"model": model, "max_tokens": max_tokens, **SAMPLERS[sampler]}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item["prompt"]}]
    else:
        body["prompt"] = item["prompt"]
    if body["temperature"] > 0:
        body["seed"] = index
    if constrained:
        body["response_format"] = response_format(item)
    return body


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def response_text(obj: dict) -> tuple:
    """(text, finish_reason, completion tokens) of a non-streaming completion or chat completion."""
    choice = (obj.get("choices") or [{}])[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("message") or {}).get("content") or ""
    return text, choice.get("finish_reason"), int((obj.get("usage") or {}).get("completion_tokens") or 0)


async def _post(client, path: str, body: dict) -> dict:
    try:
        r = await client.post(path, json=body)
    except Exception as exc:    # a failed request is a data point
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}", "status": r.status_code}
    text, finish, tokens = response_text(r.json())
    return {"text": text, "finish": finish, "tokens": tokens}


async def served_loop(base_url: str, path: str, make_body: Callable[[int], dict], clients: int,
                      duration_s: float) -> tuple:
    """`clients` workers, each sending the next request index when its last one ends, until
    `duration_s` has passed (requests in flight then are awaited). Returns ([(index, reply)], wall)."""
    import httpx

    counter, replies = itertools.count(), []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        t0 = time.perf_counter()

        async def worker():
            while time.perf_counter() - t0 < duration_s:
                i = next(counter)
                replies.append((i, await _post(client, path, make_body(i))))

        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return replies, wall


def served_run(replies: list, wall: float, items: list, checker=None) -> dict:
    """One served arm's figures from its replies (pure)."""
    tally, tokens, errors, first_error, lengths = new_tally(), 0, 0, None, {}
    for i, reply in sorted(replies, key=lambda x: x[0]):
        if reply.get("error"):
            errors += 1
            first_error = first_error or reply["error"]
            continue
        tokens += reply["tokens"]
        lengths.setdefault(items[i % len(items)]["name"], []).append(reply["tokens"])
        judge(tally, items[i % len(items)], reply["text"], reply["finish"], reply["tokens"], checker)
    return {"tok_s": tokens / wall if wall > 0 else None, "tokens": tokens, "wall_s": wall, "requests": len(replies),
            "errors": errors, "first_error": first_error, "lengths": lengths, **tally}


def lane_deltas(before: Optional[dict], after: Optional[dict]) -> dict:
    """Acceptance and rows per cycle of the replicas' lanes between two snapshots (None where a
    snapshot lacks the counters)."""
    def total(snap, key):
        reps = [rep for rep in ((snap or {}).get("replicas") or {}).values() if isinstance(rep, dict)]
        return sum(rep[key] for rep in reps) if reps and all(key in rep for rep in reps) else None

    d = {}
    for key in ("accepted_draft_tokens", "rejected_draft_tokens", "lane_cycles", "lane_row_cycles"):
        a, b = total(before, key), total(after, key)
        d[key] = None if a is None or b is None else b - a
    drafts = None if d["accepted_draft_tokens"] is None else d["accepted_draft_tokens"] + d["rejected_draft_tokens"]
    return {"acceptance": d["accepted_draft_tokens"] / drafts if drafts else None,
            "rows_per_cycle": d["lane_row_cycles"] / d["lane_cycles"] if d["lane_cycles"] else None}


def check_structured_server(base_url: str, endpoint: str, model: str) -> dict:
    """One constrained request: the server must answer it 200; else `ResponseFormatRefused`."""
    import httpx

    body = request_body(SCHEMAS[0], 0, "greedy", True, endpoint, MAX_TOKENS, model)
    r = httpx.post(base_url + endpoint_path(endpoint), json=body, timeout=600)
    if r.status_code != 200:
        raise ResponseFormatRefused(
            f"the server refused response_format json_schema on {endpoint_path(endpoint)} (HTTP {r.status_code}: "
            f"{r.text[:300]}); bench structured --served needs the HTTP side of structured output")
    text, finish, tokens = response_text(r.json())
    return {"text": text[:200], "finish_reason": finish, "completion_tokens": tokens}


def bench_structured_served(model_dir: Optional[str] = None, rounds: int = 3, duration_s: float = DURATION_S,
                            clients: Iterable[int] = SERVED_CLIENTS, max_tokens: int = MAX_TOKENS,
                            endpoint: str = "completions", ready_timeout_s: float = 600.0, warmup_s: float = 3.0,
                            log: Callable[[str], None] = LOG, config: Optional[str] = None) -> dict:
    """The served arms (see the module docstring): `served` (per client count and sampler, the
    summary), `per_round_served`, `served_setup`. `config`: the serve config (default the shipped
    serve_configs/config.yaml)."""
    from benchmarks.report import ROOT
    from benchmarks.servers import snapshot, start_ours

    clients = sorted({int(c) for c in clients})
    checker = format_checker()
    logs = ROOT / "build" / "bench" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mtplx-bench-structured-") as tmp:
        log("structured --served: starting serve run")
        server = start_ours(model_dir,
                            logs / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.log", Path(tmp), ready_timeout_s,
                            config=Path(config) if config else None)
        try:
            probe = check_structured_server(server.url, endpoint, server.model)

            lengths: dict = {}        # (clients, sampler) -> item name -> constrained completion lengths

            def bodies(name, arm, budgets=None):
                def body(i):
                    item = SCHEMAS[i % len(SCHEMAS)]
                    return request_body(item, i, name, arm == "constrained", endpoint,
                                        (budgets or {}).get(item["name"], max_tokens), server.model)
                return body

            for name in SAMPLERS:   # the grammars' and lanes' first uses: not measured
                for arm in ARMS:
                    asyncio.run(served_loop(server.url, endpoint_path(endpoint), bodies(name, arm), max(clients),
                                            warmup_s))
            per_round = []
            turns = [(n, name) for n in clients for name in SAMPLERS]
            for r in range(rounds):
                rnd: dict = {}
                for turn, (n, name) in enumerate(turns):
                    for arm in arm_order(r, turn) + (MATCHED,):
                        pooled = lengths.setdefault((n, name), {})
                        make_body = bodies(name, arm, matched_budgets(pooled) if arm == MATCHED else None)
                        before = snapshot(server.url)
                        replies, wall = asyncio.run(served_loop(server.url, endpoint_path(endpoint), make_body,
                                                                n, duration_s))
                        run = {**served_run(replies, wall, SCHEMAS, checker),
                               **lane_deltas(before, snapshot(server.url))}
                        if arm == "constrained":
                            _pool(pooled, run.pop("lengths"))
                        else:
                            run.pop("lengths")
                        rnd.setdefault(f"c{n}", {}).setdefault(name, {})[arm] = run
                        log(f"structured served round {r + 1}/{rounds} c{n} {name} {arm}: "
                            f"{run['tok_s'] or 0:.1f} tok/s, {run['requests']} requests ({run['errors']} errors), "
                            f"{run['valid']}/{run['stop']} stop valid")
                per_round.append(rnd)
        finally:
            stopped = server.stop()
    served = {f"c{n}": {name: summarize_arms([rnd[f"c{n}"][name] for rnd in per_round]) for name in SAMPLERS}
              for n in clients}
    return {"served": served, "per_round_served": per_round,
            "served_setup": {"endpoint": endpoint_path(endpoint), "clients": clients, "duration_s": duration_s,
                             "max_tokens": max_tokens, "rounds": rounds, "probe": probe, "server": server.info,
                             "stop": stopped, "config": config or "serve_configs/config.yaml"}}


# -- report -----------------------------------------------------------------------------------------

def _f(v, digits: int = 1, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v * 100:.{digits}f}%" if pct else f"{v:.{digits}f}"


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _arm_rows(label: str, summary: dict) -> List[str]:
    rows = []
    for arm in [a for a in ALL_ARMS if a in summary]:
        a = summary[arm]
        ratio = f"{_f(summary['ratio'], 3)} ({_met(summary['targets']['ratio'])})" if arm == "constrained" else ""
        if arm == "constrained" and summary.get("ratio_matched") is not None:
            ratio += f"; {_f(summary['ratio_matched'], 3)} against matched"
        valid = f"{a['valid']}/{a['valid'] + a['invalid']}" + (f" ({_f(a['validity'], 1, pct=True)})"
                                                               if a["validity"] is not None else "")
        rows.append(f"| {label} | {arm} | {_f(a['tok_s'])} | {ratio} | {_f(a['acceptance'], 3)} "
                    f"| {_f(a['rows_per_cycle'], 2)} | {_f(a['tokens_per_cycle'], 1)} | {_f(a['ms_per_step'], 1)} "
                    f"| {_f(a['host_ms_per_step'], 1)} | {_f(a['prefill_share'], 0, pct=True)} | {a['rows']} "
                    f"| {_f(a['mean_tokens_per_row'])} | {a['stop']} | {valid} | {a['length']} "
                    f"| {a['other'] + a['errors']} |")
    return rows


TABLE_HEAD = ["| {what} | arm | tok/s | constrained / unconstrained | acceptance | rows/cycle | tokens/cycle | ms/step "
              "| host ms/step | prefill | rows ended | tokens/row | stop | stop valid | length | other |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _targets_line(where: str, summaries: dict) -> str:
    parts = []
    for label, s in summaries.items():
        c = s["constrained"]
        matched = (f", against the length-matched free rows {_f(s['ratio_matched'], 3)}"
                   if s.get("ratio_matched") is not None else "")
        parts.append(f"{label}: ratio {_f(s['ratio'], 3)} ({_met(s['targets']['ratio'])}){matched}, "
                     f"validity {_f(c['validity'], 1, pct=True)} of {c['valid'] + c['invalid']} "
                     f"({_met(s['targets']['validity'])}), {c['length']} ended on max_tokens")
    return f"Targets {where} (ratio >= {TARGET_RATIO}, 100% of completed constrained outputs valid): " + \
        "; ".join(parts) + "."


def _invalid_lines(summaries: dict) -> List[str]:
    lines = []
    for label, s in summaries.items():
        for e in s["constrained"]["invalid_examples"]:
            lines.append(f"- {label}, `{e['schema']}`: {e['error']}: `{e['text']}`")
    return ["", "Invalid constrained outputs (first few):", *lines] if lines else []


def render_structured(record: dict, image: str) -> str:
    max_tokens = record.get("options", {}).get("max_tokens", MAX_TOKENS)
    lines = ["## bench structured: rows following a JSON schema against the same rows free", "",
             f"`{record['command']}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. "
             f"Model: {record['model']}.",
             machine_line(record["machine"]), "",
             f"{len(SCHEMAS)} schemas of `benchmarks/schemas.py`, each with a code prompt; request i takes schema i "
             f"mod {len(SCHEMAS)}. Arms: constrained (the row follows its schema) and unconstrained (same prompts, no "
             f"constraint), `max_tokens` {max_tokens} both, greedy and t0.6 (top_p 0.95, top_k 20, seed = request "
             "index); the two arms alternate, each first as often; figures are medians over rounds, the ratio the "
             "median of per-round ratios; ended rows are pooled over rounds. Stop valid: rows ended \"stop\" whose "
             "text is JSON that validates (formats checked); length: rows cut at `max_tokens`, not judged."]
    if record.get("lane"):
        s = record["lane_setup"]
        depths = ", ".join(f"B{w} {d}" for w, d in s["greedy_depths"].items())
        lines += ["", f"**In process**: the B{s['width']} lane a replica installs (self-checked; greedy depths by "
                      f"cost {depths}, sampled depth {s['sampled_depth']}, drafts drawn on the {s['draft_draw']}) in "
                      "the running lane the service starts, rows as the service makes them "
                      f"(`generation_mode` auto); BLAS threads {s['blas_threads']}. Closed loop: {s['width']} rows "
                      f"live, each ended row replaced by the next request, {s['duration_s']:.0f} s per arm, "
                      f"{s['rounds']} round(s). tok/s: tokens returned / wall time (new rows' prefills included); "
                      "tokens/cycle: tokens returned per lane step; ms/step and host ms/step: a step's time (MTP "
                      "cycle or AR step) and of it the host's (draws, grammar masks, accept tests); prefill: share of "
                      "the wall time in new rows' prefills. Constrained rows end sooner, so more of their time goes "
                      "to prefills; the unconstrained rows of this tiny model often fall into loops its head "
                      "predicts well (see acceptance). A third arm, matched, runs the same rows free with each "
                      "row's budget its item's median constrained length (so as many rows, prefills and tokens a "
                      "row as the constrained arm; it runs after the other two in each turn): against it the "
                      "ratio is the grammar's own cost.",
                  "", *[ln.format(what="sampler") for ln in TABLE_HEAD],
                  *[r for name, summ in record["lane"].items() for r in _arm_rows(name, summ)],
                  "", _targets_line("in process", record["lane"])]
        lines += _invalid_lines(record["lane"])
    served = record.get("served")
    if served and "error" in served:
        lines += ["", f"**Served**: not measured: {served['error']}"]
    elif served:
        s = record["served_setup"]
        lines += ["", f"**Served**: `serve run` of {s.get('config', 'serve_configs/config.yaml')}, non-streaming `{s['endpoint']}`, "
                      f"constrained requests with `response_format` json_schema (strict); closed loops of "
                      f"{', '.join(map(str, s['clients']))} client(s), {s['duration_s']:.0f} s per arm, {s['rounds']} "
                      "round(s); tok/s: usage completion tokens / wall time; acceptance and rows/cycle from the "
                      "replicas' snapshot around each arm. Matched: the free requests with each one's `max_tokens` "
                      "its schema's median constrained completion so far (as many requests and tokens a request "
                      "as the constrained arm).",
                  "", *[ln.format(what="clients, sampler") for ln in TABLE_HEAD],
                  *[r for c, per in served.items() for name, summ in per.items()
                    for r in _arm_rows(f"{c[1:]}, {name}", summ)],
                  "", _targets_line("served", {f"{c[1:]} client(s) {name}": summ for c, per in served.items()
                                              for name, summ in per.items()})]
        lines += _invalid_lines({f"{c} {name}": summ for c, per in served.items() for name, summ in per.items()})
    return "\n".join(lines + ["", f"![bench structured]({image})"]) + "\n"


def plot_structured(record: dict, path) -> None:
    plt = pyplot()
    served = record.get("served") if "error" not in (record.get("served") or {"error": 1}) else None
    panels = [p for p in (("in process, 8 rows", record.get("lane")),
                          ("served", {f"{c[1:]}c {n}": s for c, per in (served or {}).items() for n, s in per.items()}))
              if p[1]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4.2), squeeze=False)
    for ax, (title, summaries) in zip(axes[0], panels):
        cats = list(summaries)
        grouped_bars(ax, cats, {arm: [summaries[c][arm]["tok_s"] for c in cats] for arm in ARMS}, "tok/s",
                     f"{title}: constrained / unconstrained " +
                     ", ".join(_f(summaries[c]["ratio"], 2) for c in cats))
    save_figure(fig, path, record)


# -- the command ------------------------------------------------------------------------------------

def run_cli(a) -> int:
    """`mtplx bench structured`: the in-process arms (unless `--served-only`), the served ones with
    `--served`; writes the record, chart and section (`bench:structured`; `--quick`:
    `bench:structured-quick`). Returns 1 when the server refused structured output."""
    import mtplx
    from benchmarks.report import machine_info, new_record, write_report

    rounds = 1 if a.quick else a.rounds
    duration = a.duration or (QUICK_DURATION_S if a.quick else DURATION_S)
    max_tokens = a.tokens or MAX_TOKENS
    clients = [int(c) for c in a.clients.split(",")] if a.clients else list(SERVED_CLIENTS)
    served = a.served or a.served_only
    machine, started = machine_info(), time.time()
    result: dict = {}
    if not a.served_only:
        model = mtplx.load_model(a.model)
        result.update(bench_structured_lane(model, rounds, duration, max_tokens, blas_threads=a.blas_threads,
                                            warmup_s=1.0 if a.quick else 3.0))
    failed = None
    if served:
        try:
            result.update(bench_structured_served(a.model, rounds, duration, clients, max_tokens, a.endpoint,
                                                  warmup_s=1.0 if a.quick else 3.0, config=a.config))
        except ResponseFormatRefused as exc:
            failed = str(exc)
            result["served"] = {"error": failed}
    options = {"rounds": rounds, "duration_s": duration, "max_tokens": max_tokens, "quick": a.quick,
               "served": served, "lane": not a.served_only, "endpoint": a.endpoint,
               "clients": clients if served else None}
    record = new_record("structured", result, a.command_line, a.model or "shipped", options, machine,
                        time.time() - started)
    if not a.no_report:
        section = "structured" + ("-quick" if a.quick else "") + (f"-{Path(a.model).name}" if a.model else "")
        artifacts = write_report(record, render_structured, plot_structured, name=section)
        print(f"JSON: {artifacts['json']}\nchart: {artifacts['png']}\nsection: {artifacts['markdown']}",
              file=sys.stderr, flush=True)
    print(json.dumps(record, default=str) if a.json else json.dumps(record, indent=2, default=str))
    if failed:
        print(f"bench structured: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0
