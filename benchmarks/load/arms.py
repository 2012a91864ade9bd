"""`bench load`'s arms against one running server: the closed and open loops of each temperature
(`run_turn`), and for ours the generation-mode and logprobs arms, run side by side."""

from __future__ import annotations

import asyncio
from typing import Callable, Dict, List, Optional

from benchmarks.load.clients import closed_loop, open_loop
from benchmarks.load.summary import cycle_breakdown, drafting, lane_occupancy, summarize_arm
from benchmarks.load.workload import (LONG_ARM_REQUESTS, LONG_ARM_TOKENS, LONG_EVERY, OPEN_LOOP_LOAD, Arm,
                                      arm_label, closed_loop_requests, long_prompt_for, poisson_arrivals,
                                      request_body)
from benchmarks.servers import ServerProcess, snapshot, snapshot_with


def _warm_up(server: ServerProcess, temperatures: List[Arm], clients: int, send_seed: bool) -> None:
    """At each temperature, short requests alone (short and long prompts), then a wave of `clients`
    at the arms' own budgets: lanes, connections and the compiled graphs of the spans the arms
    reach are ready before anything is timed. Why full budgets: a lane traces a graph at each new
    64-position span once (0.5-0.7 s on Gemma 3 270M at width 8), which a running server pays
    once; 16-token warm-ups left that to the timed arms."""
    for t in temperatures:
        bodies = [request_body(i, t, server.model, send_seed) for i in range(max(clients, LONG_EVERY))]
        asyncio.run(closed_loop(server.url, [{**b, "max_tokens": 16} for b in bodies[:LONG_EVERY]], 1))
        asyncio.run(closed_loop(server.url, bodies, clients))


def run_turn(server: ServerProcess, plan: dict, run: int, open_rate: Dict[Arm, Optional[float]],
             send_seed: bool, log: Callable[[str], None]) -> dict:
    """Every arm of the plan against one running server. `open_rate[t]` is the open-loop rate at
    temperature t (or of the mixed arm); when None (the peer's turn) it is taken from this turn's
    closed loop at CAPACITY_CLIENTS clients. Returns {"arms": {key: summary}, "rows": {key: rows}, "rates": ...}."""
    arms, rows_by_arm, rates = {}, {}, {}
    _warm_up(server, plan["temperatures"], max(plan["clients"]), send_seed)
    for t in plan["temperatures"]:
        label = arm_label(t)
        for n in plan["clients"]:
            key = f"{label}/closed-{n}"
            count = closed_loop_requests(n, plan["per_client"], plan["min_requests"])
            bodies = [request_body(i, t, server.model, send_seed) for i in range(count)]
            arms[key], rows_by_arm[key] = _timed_arm(server, lambda at_drain: closed_loop(server.url, bodies, n,
                                                                                          at_drain))
            log(f"  {server.kind:4s} {key:18s} {_brief(arms[key])}")
        if not plan["open_requests"]:
            continue
        rate = open_rate.get(t)
        if rate is None:
            capacity_arm = f"{label}/closed-{plan['capacity_clients']}"
            rate = OPEN_LOOP_LOAD * arms[capacity_arm]["req_s"]
        rates[t] = rate
        key = f"{label}/open"
        arrivals = poisson_arrivals(plan["open_requests"], rate, plan["seed"] + run)
        bodies = [request_body(i, t, server.model, send_seed) for i in range(plan["open_requests"])]
        arms[key], rows_by_arm[key] = _timed_arm(server, lambda _: open_loop(server.url, bodies, arrivals))
        arms[key]["offered_req_s"] = rate
        log(f"  {server.kind:4s} {key:18s} {_brief(arms[key])} (offered {rate:.2f} req/s)")
    if plan.get("long_prompt_tokens"):
        key = f"{arm_label(0.0)}/long-{plan['long_prompt_tokens']}"
        arms[key], rows_by_arm[key] = _long_prompt_arm(server, plan["long_prompt_tokens"], send_seed)
        log(f"  {server.kind:4s} {key:18s} {_brief(arms[key])} (prompt tokens {arms[key]['prompt_tokens_p50']})")
    return {"arms": arms, "rows": rows_by_arm, "rates": rates}


def _long_prompt_arm(server: ServerProcess, tokens: int, send_seed: bool) -> tuple:
    """Time to first token on prompts of about `tokens` tokens: greedy requests one at a time,
    after one unmeasured request of that length (its prefill shapes compiled, its caches grown)."""
    def body(i):
        return {**request_body(i, 0.0, server.model, send_seed), "prompt": long_prompt_for(i, tokens),
                "max_tokens": LONG_ARM_TOKENS}

    asyncio.run(closed_loop(server.url, [body(LONG_ARM_REQUESTS)], 1))
    bodies = [body(i) for i in range(LONG_ARM_REQUESTS)]
    return _timed_arm(server, lambda at_drain: closed_loop(server.url, bodies, 1, at_drain))


def run_mode_arms(server: ServerProcess, plan: dict, run: int, log: Callable[[str], None]) -> dict:
    """Ours only: every closed-loop arm twice per generation mode of `plan["modes"]`, in a rotation
    (turned per arm and run) and then its reverse, so that a load drifting over the arm weighs on
    every mode alike; each mode's figures pool both of its halves. Returns {mode: {arm key: summary}}."""
    modes = plan["modes"]

    def mirrored(k):
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        return order + order[::-1]

    return _side_arms(server, plan, run, log, mirrored, lambda mode: {"generation_mode": mode})


def _side_arms(server: ServerProcess, plan: dict, run: int, log: Callable[[str], None],
               sequence_for: Callable[[int], List[str]], extra_for: Callable[[str], dict], tag: str = "") -> dict:
    """Every closed-loop arm of `plan`, its sides in the order `sequence_for(run + arm index)`
    (pooled by `_pooled_arms`), each side's requests the arm's bodies plus `extra_for(side)`.
    Returns {side: {arm key: summary}}."""
    out: Dict[str, dict] = {}
    for t in plan["temperatures"]:
        label = arm_label(t)
        for j, n in enumerate(plan["clients"]):
            key = f"{label}/closed-{n}"
            count = closed_loop_requests(n, plan["per_client"], plan["min_requests"])
            pooled = _pooled_arms(server, sequence_for(run + j), n, log, key + tag,
                                  lambda side: [{**request_body(i, t, server.model, True), **extra_for(side)}
                                                for i in range(count)])
            for side, summary in pooled.items():
                out.setdefault(side, {})[key] = summary
    return out


def _pooled_arms(server: ServerProcess, sequence: List[str], clients: int, log: Callable[[str], None],
                 key: str, bodies_for: Callable[[str], List[dict]]) -> Dict[str, dict]:
    """Closed loops of `clients` in the order of `sequence` (a side may recur); each side's
    summary pools all of its runs' rows and wall time. With one client the sides take turns
    request by request instead (`_alternating_requests`): the same requests, with no arm-long
    drift between them."""
    if clients == 1:
        return _alternating_requests(server, sequence, log, key, bodies_for)
    halves: Dict[str, tuple] = {}
    for side in sequence:
        bodies = bodies_for(side)
        summary, rows = _timed_arm(server, lambda at_drain: closed_loop(server.url, bodies, clients, at_drain))
        log(f"  {server.kind:4s} {key:18s} {side:4s} {_brief(summary)}")
        prev_rows, prev_wall = halves.get(side, ([], 0.0))
        halves[side] = (prev_rows + rows, prev_wall + summary["wall_s"])
    return {side: summarize_arm(rows, wall) for side, (rows, wall) in halves.items()}


def _alternating_requests(server: ServerProcess, sequence: List[str], log: Callable[[str], None], key: str,
                          bodies_for: Callable[[str], List[dict]]) -> Dict[str, dict]:
    """One client sends request i of every side back to back, the sides' order reversed at every
    other i, each side as many times over as it recurs in `sequence`. A side's figures are over its
    own requests, its wall time the sum of their end-to-end times. At one client, 12-request arms
    of identical work moved by 15% between arms; request pairs share the machine's state."""
    sides = list(dict.fromkeys(sequence))
    bodies = {side: bodies_for(side) for side in sides}
    count = len(bodies[sides[0]])
    order = [(side, bodies[side][i % count]) for i in range(count * sequence.count(sides[0]))
             for side in (sides if i % 2 == 0 else sides[::-1])]
    _, rows = _timed_arm(server, lambda _: closed_loop(server.url, [body for _, body in order], 1))
    out = {}
    for side in sides:
        mine = [row for (s, _), row in zip(order, rows) if s == side]
        out[side] = summarize_arm(mine, sum(row["e2e"] or 0.0 for row in mine))
        log(f"  {server.kind:4s} {key:18s} {side:4s} {_brief(out[side])} (alternating requests)")
    return out


def run_logprob_arms(server: ServerProcess, plan: dict, run: int, log: Callable[[str], None]) -> dict:
    """Ours only: every closed-loop arm without and with `logprobs: plan["logprobs"]`, twice each
    in the order off, on, on, off (reversed per arm and run), so that neither side always runs
    first or last on a machine whose load drifts; each side's figures are over both of its halves.
    Returns {"off" | "on": {arm key: summary}}."""
    return _side_arms(server, plan, run, log,
                      lambda k: ["off", "on", "on", "off"] if k % 2 == 0 else ["on", "off", "off", "on"],
                      lambda side: {"logprobs": plan["logprobs"]} if side == "on" else {}, tag=" logprobs")


def _timed_arm(server: ServerProcess, run: Callable) -> tuple:
    """One arm, `run(at_drain)`, with lane snapshots around it for our server, and for a closed
    loop one more when its first client runs out of requests: `steady_lane_occupancy` is the
    lanes' rows per cycle while every client still had requests, apart from the drain at the
    arm's end (its last requests finishing with fewer and fewer neighbours)."""
    ours = server.kind == "ours"
    before = snapshot(server.url) if ours else None
    drained: dict = {}

    async def at_drain(client):
        drained["snapshot"] = await snapshot_with(client)

    rows, wall = asyncio.run(run(at_drain if ours else None))
    summary = summarize_arm(rows, wall)
    if ours:
        after = snapshot(server.url)
        summary["lane_occupancy"] = lane_occupancy(before, after)
        summary["steady_lane_occupancy"] = lane_occupancy(before, drained.get("snapshot"))
        summary["cycle_breakdown"] = cycle_breakdown(before, after, wall)
        summary.update(drafting(before, after) or {})    # numbers at the top: the runs' medians reach the table
    return summary, rows


def _brief(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:.0f}"

    cb = s.get("cycle_breakdown")
    where = "" if not cb else (
        f"  cycle {cb['cycle_ms']['cycles']:.1f} ms (device {cb['cycle_ms']['device']:.1f}, host "
        f"{cb['cycle_ms']['host']:.1f}, graphs+books {cb['cycle_ms']['graphs_and_books']:.1f}); wall: cycles "
        f"{cb['wall_share']['cycles']:.0%}, prefill {cb['wall_share']['prefill']:.0%}, delivery {cb['wall_share']['delivery']:.0%}")
    if s.get("drafts_per_row_cycle") is not None:
        where += f"; drafts/row-cycle {s['drafts_per_row_cycle']:.2f}, accepted {s['accepted_share'] or 0:.0%}"
    return (f"{s['tok_s'] or 0:7.1f} tok/s  TTFT p95 {ms(s['ttft_p95_s'])} ms  ITL p50 {ms(s['itl_p50_s'])} ms"
            f"  errors {s['errors']}{where}")
