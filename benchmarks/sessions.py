"""`mtplx bench sessions`: multi-turn chat sessions on two nodes, affinity routing against Serve's
power of two choices; then a model replica killed with `kill -9` under load.

The cluster is the scale-out check's (`deployments.scaleout.loopback_cluster`): a head node and
two nodes with {"mlx": 1}, one model replica each, every node on loopback. Each arm runs on a
fresh deploy (new replicas: prefix caches empty), the arms in turn, rotated per run:
  * `power_of_two`: `routing: power_of_two`, Serve's choice (what every request got before);
  * `affinity`: `routing: affinity`, each request with its session's `x-session-id`;
  * `prefix`: `routing: affinity` with no session header: routed by the longest cached prefix.

Workload: 16 sessions at once (their starts 0.25 s apart), each a closed loop over 4 turns (a
turn is sent when the last one's answer is in). Every session has the same system prompt (about
420 tokens); each turn adds a user message of about 260 tokens of Python source, its own per
session and turn, and the last answer; answers are greedy, 32 tokens (`ignore_eos`). The prefix
cache banks a prompt's state at every 256-token block, so a turn can reuse the whole blocks of
the turn before on that turn's replica, and only the system prompt's first block elsewhere.

Per arm (medians over runs): conversation hits (turns 2-4 whose cached prompt tokens cover every
whole block of the turn before's prompt: the replica held the conversation so far), the share of
prompt tokens served from the cache in turns 2-4, the prompt tokens turn 2 prefilled, time to
first text p50/p95 (turn 1; turns 2-4), completion tok/s over the arm's wall time, rows per
cohort call (the ingress's batch windows are split per replica under affinity) and per lane
cycle (the replicas' running lanes), and each replica's hit rates. 2 CPUs carry two nodes here:
tok/s does not scale, hit rates and time to first token are the figures that carry.

The kill (after the arms, on the affinity deploy): the scale-out check's eight loaded requests
(greedy, seeded and unseeded sampled; `LOAD_TOKENS` tokens each, streaming) at once, and `kill -9` of the
replica process holding the most rows once every stream has text. Every request must complete
with all its tokens, each greedy or seeded text equal to its undisturbed text.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

SESSIONS, TURNS, ANSWER_TOKENS = 16, 4, 32
BLOCK = 256                                    # the prefix cache's block (mtplx.engine.prefill.PREFILL_CHUNK)
ARMS = {"power_of_two": ({"routing": "power_of_two"}, True), "affinity": ({"routing": "affinity"}, True),
        "prefix": ({"routing": "affinity"}, False)}
SYSTEM = ("You are a careful Python reviewer. You read code, say what it does, point out bugs and suggest "
          "small fixes. ") * 12
SLICE_CHARS = 900


def user_message(session: int, turn: int) -> str:
    """Turn `turn` of session `session`: its own slice of a standard-library module's source."""
    import argparse

    src = Path(argparse.__file__).read_text()
    at = ((session * TURNS + turn) * SLICE_CHARS) % max(1, len(src) - SLICE_CHARS)
    return f"[session {session}, part {turn + 1}] What does this code do?\n{src[at:at + SLICE_CHARS]}"


async def _session(client, session: int, header: bool, start_s: float) -> List[dict]:
    from deployments.scaleout import stream_chat

    await asyncio.sleep(start_s)
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": user_message(session, turn)})
        res = await stream_chat(client, {"messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0.0,
                                         "ignore_eos": True},
                                headers={"x-session-id": f"bench-{session}"} if header else None)
        usage = res["usage"] or {}
        turns.append({"session": session, "turn": turn, "error": res["error"], "ttft_s": res["ttft_s"],
                      "replica": (res["stats"] or {}).get("replica_id"), "prompt_tokens": usage.get("prompt_tokens"),
                      "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                      "completion_tokens": usage.get("completion_tokens") or 0})
        messages.append({"role": "assistant", "content": res["text"]})
    return turns


async def _sessions(base: str, header: bool) -> List[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        out = await asyncio.gather(*[_session(client, s, header, 0.25 * s) for s in range(SESSIONS)])
    return [t for turns in out for t in turns]


def _replicas(snapshot: dict) -> Dict[str, dict]:
    return {rid: s for rid, s in snapshot["replicas"].items() if isinstance(s, dict) and "pid" in s}


def _conversation_hit(turn: dict, before: dict) -> bool:
    return turn["cached_tokens"] >= BLOCK * ((before["prompt_tokens"] or 0) // BLOCK)


def _quantile(xs: List[float], q: float) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _delta_hist(after: dict, before: dict) -> Dict[int, int]:
    return {int(k): v - int(before.get(k, 0)) for k, v in after.items() if v - int(before.get(k, 0)) > 0}


def _mean_of_hist(hist: Dict[int, int]) -> Optional[float]:
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else None


def _replica_figures(turns: List[dict], before: Dict[str, dict], after: Dict[str, dict]) -> Dict[str, dict]:
    """Each replica's own counters (its prefix cache over the rows it finished: the arm's alone,
    as a warm-up's rows do not pass through cohort calls), its lanes' row-cycles and cycles
    during the arm (the warm-up's left out), and the conversation hits of the turns it served."""
    out = {}
    for rid, snap in after.items():
        pc = snap.get("prefix_cache") or {}
        was = before.get(rid) or {}
        later = [t for t in turns if t["replica"] == rid and t["turn"] > 0]
        out[rid] = {"rows": pc.get("requests"), "request_hit_rate": pc.get("request_hit_rate"),
                    "token_hit_rate": pc.get("token_hit_rate"), "later_turns": len(later),
                    "conversation_hits": sum(t["hit"] for t in later),
                    "lane_row_cycles": (snap.get("lane_row_cycles") or 0) - (was.get("lane_row_cycles") or 0),
                    "lane_cycles": (snap.get("lane_cycles") or 0) - (was.get("lane_cycles") or 0)}
    return out


def _arm_figures(turns: List[dict], wall_s: float, before: dict, after: dict) -> dict:
    """The arm's figures from its turns and the app's snapshots before and after it."""
    ingress_before, ingress_after = before["ingress"], after["ingress"]
    by_key = {(t["session"], t["turn"]): t for t in turns}
    for t in turns:
        t["hit"] = t["turn"] > 0 and _conversation_hit(t, by_key[(t["session"], t["turn"] - 1)])
    later = [t for t in turns if t["turn"] > 0 and not t["error"]]
    second = [t for t in turns if t["turn"] == 1 and not t["error"]]
    cohorts = _delta_hist(ingress_after["cohort_size_histogram"], ingress_before.get("cohort_size_histogram") or {})
    windows = _delta_hist(ingress_after["batch_size_histogram"], ingress_before.get("batch_size_histogram") or {})
    lanes = _replica_figures(turns, _replicas(before), _replicas(after))
    row_cycles = sum(r["lane_row_cycles"] for r in lanes.values())
    cycles = sum(r["lane_cycles"] for r in lanes.values())
    decisions_before = (ingress_before.get("routing") or {}).get("decisions") or {}
    return {
        "errors": sum(1 for t in turns if t["error"]),
        "conversation_hit_rate": sum(t["hit"] for t in later) / len(later) if later else None,
        "later_token_hit_rate": (sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later))
                                 if later else None),
        "turn2_prefilled_tokens": statistics.mean(t["prompt_tokens"] - t["cached_tokens"] for t in second) if second else None,
        "turn2_prompt_tokens": statistics.mean(t["prompt_tokens"] for t in second) if second else None,
        "ttft_first_p50_s": _quantile([t["ttft_s"] for t in turns if t["turn"] == 0], 0.5),
        "ttft_first_p95_s": _quantile([t["ttft_s"] for t in turns if t["turn"] == 0], 0.95),
        "ttft_later_p50_s": _quantile([t["ttft_s"] for t in later], 0.5),
        "ttft_later_p95_s": _quantile([t["ttft_s"] for t in later], 0.95),
        "tok_s": sum(t["completion_tokens"] for t in turns) / wall_s,
        "wall_s": wall_s,
        "rows_per_cohort": _mean_of_hist(cohorts), "rows_per_window": _mean_of_hist(windows),
        "rows_per_lane_cycle": row_cycles / cycles if cycles else None,
        "decisions": {k: v - int(decisions_before.get(k, 0))
                      for k, v in ((ingress_after.get("routing") or {}).get("decisions") or {}).items()},
        "replicas": lanes,
    }


def run_arm(app, arm: str, revision: str) -> dict:
    """One arm on a fresh deploy: the sessions, and the figures."""
    args, header = ARMS[arm]
    app.deploy(num_replicas=2, revision=revision, warmup=True, **args)
    before = app.snapshot()
    t0 = time.perf_counter()
    turns = asyncio.run(_sessions(app.base, header))
    wall_s = time.perf_counter() - t0
    figures = _arm_figures(turns, wall_s, before, app.snapshot())
    figures["turns"] = turns
    return figures


def run_kill(app) -> dict:
    from deployments.scaleout import kill_busiest, references, under_load

    app.deploy(num_replicas=2, revision="kill", warmup=True, routing="affinity")
    refs = asyncio.run(references(app))
    return under_load(app, refs, lambda: kill_busiest(app), once=True)


def bench_sessions(runs: int = 2, arms=tuple(ARMS), kill: bool = True) -> dict:
    from deployments.scaleout import loopback_cluster

    by_arm: Dict[str, List[dict]] = {a: [] for a in arms}
    out: dict = {"runs": runs, "arms": list(arms), "sessions": SESSIONS, "turns": TURNS,
                 "answer_tokens": ANSWER_TOKENS}
    with loopback_cluster() as app:
        for run in range(runs):
            order = list(arms[run % len(arms):]) + list(arms[:run % len(arms)])
            for arm in order:
                by_arm[arm].append(run_arm(app, arm, revision=f"{run}-{arm}"))
        if kill:
            out["kill"] = run_kill(app)
    out["by_arm"] = by_arm
    out["summary"] = {arm: summarize(results) for arm, results in by_arm.items()}
    return out


SUMMARY_KEYS = ("conversation_hit_rate", "later_token_hit_rate", "turn2_prefilled_tokens", "turn2_prompt_tokens",
                "ttft_first_p50_s", "ttft_first_p95_s", "ttft_later_p50_s", "ttft_later_p95_s", "tok_s",
                "rows_per_cohort", "rows_per_window", "rows_per_lane_cycle")


def summarize(results: List[dict]) -> dict:
    """Medians over runs; errors summed."""
    out = {k: statistics.median(v) if (v := [r[k] for r in results if r[k] is not None]) else None
           for k in SUMMARY_KEYS}
    out["errors"] = sum(r["errors"] for r in results)
    return out


# -- report ---------------------------------------------------------------------------------------

def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(record: dict, png: str) -> str:
    from benchmarks.report import machine_line

    s = record["summary"]
    base = (s.get("power_of_two") or {}).get("ttft_later_p50_s")
    lines = ["## bench sessions: affinity routing against power of two, two nodes", "",
             f"`{record['command']}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. Model: {record['model']}.",
             machine_line(record["machine"]), "",
             f"{record['sessions']} chat sessions of {record['turns']} turns at once on a loopback cluster of a head "
             f"and two MLX nodes (one model replica each); one shared system prompt of about 420 tokens, each turn "
             f"about 260 tokens of its own and a greedy answer of {record['answer_tokens']} tokens. Each arm on a "
             f"fresh deploy (caches empty), arms rotated over {record['runs']} runs; medians over runs. Hit: a turn "
             f"2-4 whose cached prompt tokens cover every whole 256-token block of the turn before's prompt. "
             f"Rows per cohort: rows per cohort call from the ingress (its batch windows split per replica under "
             f"affinity); per lane cycle: the replicas' running lanes.", "",
             "| arm | hits, turns 2-4 | prompt from cache, turns 2-4 | turn 2 prefilled / prompt tokens | "
             "TTFT p50 / p95 ms, turn 1 | TTFT p50 / p95 ms, turns 2-4 | TTFT p50 turns 2-4 vs power of two | "
             "tok/s | rows per window / cohort / lane cycle | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in record["arms"]:
        a = s[arm]
        ratio = "-" if not base or a["ttft_later_p50_s"] is None else f"{a['ttft_later_p50_s'] / base:.2f}x"
        lines.append(
            f"| {arm} | {_pct(a['conversation_hit_rate'])} | {_pct(a['later_token_hit_rate'])} | "
            f"{_num(a['turn2_prefilled_tokens'], 0)} / {_num(a['turn2_prompt_tokens'], 0)} | "
            f"{_ms(a['ttft_first_p50_s'])} / {_ms(a['ttft_first_p95_s'])} | {_ms(a['ttft_later_p50_s'])} / "
            f"{_ms(a['ttft_later_p95_s'])} | {ratio} | {_num(a['tok_s'])} | {_num(a['rows_per_window'], 2)} / "
            f"{_num(a['rows_per_cohort'], 2)} / {_num(a['rows_per_lane_cycle'], 2)} | {a['errors']} |")
    lines += ["", "Per replica, last run (its own counters: rows it finished, the share with any cached prompt "
              "token (the shared system prompt counts), the share of prompt tokens from its cache; and the "
              "conversation hits of the later turns it served); routing decisions of the run:", "",
              "| arm | replica | rows | rows with a cached prefix | prompt tokens from cache | later turns: hits | "
              "routed (session / prefix / spill / fallback / power of two) |", "|---|---|---:|---:|---:|---:|---|"]
    for arm in record["arms"]:
        last = record["by_arm"][arm][-1]
        d = last["decisions"]
        routed = " / ".join(str(d.get(k, 0)) for k in ("session", "prefix", "spill", "fallback", "power_of_two"))
        for rid, r in sorted(last["replicas"].items()):
            lines.append(f"| {arm} | `{rid[-8:]}` | {r['rows']} | {_pct(r['request_hit_rate'])} | "
                         f"{_pct(r['token_hit_rate'])} | {r['conversation_hits']} of {r['later_turns']} | {routed} |")
    if record.get("kill"):
        k = record["kill"]
        lines += ["", f"**kill -9 under load**: {k['requests']} streaming requests (greedy, seeded and unseeded "
                  f"sampled, {k['expected_tokens'] // max(1, k['requests'])} tokens each); the replica holding the most rows ({k.get('rows_on_it')}) killed once "
                  f"every stream had text.", "",
                  "| requests | whole (every token, no error) | greedy/seeded texts as undisturbed | completion tokens / asked "
                  "| rows moved | moves failed | longest pause in a stream s |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {k['requests']} | {k['requests'] - len(k['problems'])} | {k['identical']} of {k['deterministic']} "
                  f"| {k['completion_tokens']} / {k['expected_tokens']} | {k['rows_moved']} | {k['row_moves_failed']} "
                  f"| {k['longest_pause_s']:.1f} |"]
    lines += ["", f"![bench sessions]({png})"]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    from benchmarks.report import grouped_bars, pyplot, save_figure

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    arms, s = record["arms"], record["summary"]
    grouped_bars(ax1, arms, {"hits, turns 2-4 %": [100 * (s[a]["conversation_hit_rate"] or 0) for a in arms],
                             "prompt from cache %": [100 * (s[a]["later_token_hit_rate"] or 0) for a in arms]},
                 "%", "prefix cache, turns 2-4")
    grouped_bars(ax2, arms, {"p50": [1000 * (s[a]["ttft_later_p50_s"] or 0) for a in arms],
                             "p95": [1000 * (s[a]["ttft_later_p95_s"] or 0) for a in arms]},
                 "ms", "time to first text, turns 2-4")
    save_figure(fig, path, record)


def run_cli(runs: int = 2, quick: bool = False, json_out: bool = False, no_report: bool = False,
            command: str = "mtplx bench sessions") -> dict:
    from benchmarks.report import machine_info, new_record, write_report

    machine, started = machine_info(), time.time()
    result = bench_sessions(runs=1 if quick else runs, arms=("power_of_two", "affinity") if quick else tuple(ARMS))
    record = new_record("sessions", result, command, "shipped", {"runs": result["runs"], "quick": quick}, machine,
                        time.time() - started)
    if not no_report:
        write_report(record, render, plot)
    print(json.dumps(record, default=str) if json_out else render(record, "docs/bench_sessions.png"), flush=True)
    return record
