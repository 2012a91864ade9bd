"""`python -m benchmarks.regress OLD_TREE`: this tree's server against another build's (a checkout
of the commit before a change), both up for the whole comparison, `bench load`'s closed-loop arms
alternating arm by arm, texts compared request by request. Options: --runs 3, --clients 1,8,
--temperatures 0,0.6 (numbers, and `mixed` for per-request settings). The other build runs from its own tree (its config, its code through
PYTHONPATH). With --old-accepts-session-id (a build from before issue 41) each server is checked
to be the build it should be: this one refuses `session_id`, those accepted it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import benchmarks.servers as servers
from benchmarks.load.arms import _timed_arm, _warm_up
from benchmarks.load.clients import closed_loop
from benchmarks.load.workload import arm_label, closed_loop_requests, parse_temperatures, request_body
from benchmarks.report import ROOT as NEW


def start(tree: Path, log: Path, work: Path, name: str, check: bool = False):
    import httpx

    servers.ROOT = tree                      # its config and its cwd
    os.environ["PYTHONPATH"] = str(tree)     # its code, in the driver and Ray's workers
    try:
        server = servers.start_ours(None, log, work, 600.0)
    finally:
        servers.ROOT = NEW
    if not check:
        return server
    # which build answers: the new one refuses `session_id`, the old one accepted it
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": 1,
                                                         "session_id": "s"}, timeout=60)
    assert (r.status_code == 400) == (name == "new"), (name, r.status_code, r.text[:200])
    return server


def arm(server, t, n):
    count = closed_loop_requests(n, 6, 12)
    bodies = [request_body(i, t, server.model, True) for i in range(count)]
    summary, rows = _timed_arm(server, lambda at_drain: closed_loop(server.url, bodies, n, at_drain))
    return {"tok_s": summary["tok_s"], "texts": [r.get("text") for r in rows]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--out", type=Path, default=NEW / "build" / "regress.json")
    ap.add_argument("--old-accepts-session-id", action="store_true")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    temps = parse_temperatures(a.temperatures)
    builds = {"old": a.old.resolve(), "new": NEW}
    per_run = []
    with tempfile.TemporaryDirectory() as tmp:
        # both servers up for the whole comparison, arm by arm in alternating order: a machine
        # whose speed drifts weighs on both alike (an idle server's Ray daemons cost both the same)
        running = {name: start(builds[name], NEW / "build" / f"regress-{name}.log", Path(tmp), name,
                               a.old_accepts_session_id)
                   for name in ("old", "new")}
        try:
            for name, server in running.items():
                _warm_up(server, temps, max(clients), True)
            for run in range(a.runs):
                res = {"old": {}, "new": {}}
                for i, (t, n) in enumerate((t, n) for t in temps for n in clients):
                    order = ["old", "new"] if (run + i) % 2 == 0 else ["new", "old"]
                    for name in order:
                        res[name][f"{arm_label(t)}/closed-{n}"] = arm(running[name], t, n)
                print(f"run {run + 1}: " + "  ".join(f"{k} {res['new'][k]['tok_s'] / res['old'][k]['tok_s']:.3f}"
                                                      for k in res["new"]), flush=True)
                per_run.append(res)
        finally:
            for server in running.values():
                server.stop()
    keys = list(per_run[0]["new"])
    summary = {}
    for k in keys:
        ratios = [r["new"][k]["tok_s"] / r["old"][k]["tok_s"] for r in per_run]
        same = sum(x == y for r in per_run for x, y in zip(r["new"][k]["texts"], r["old"][k]["texts"]))
        total = sum(len(r["new"][k]["texts"]) for r in per_run)
        summary[k] = {"new_over_old_median": statistics.median(ratios), "per_run": ratios,
                      "new_tok_s": [r["new"][k]["tok_s"] for r in per_run],
                      "old_tok_s": [r["old"][k]["tok_s"] for r in per_run], "texts_identical": f"{same}/{total}"}
        print(f"{k:16s} new/old {summary[k]['new_over_old_median']:.3f}  per run "
              f"{', '.join(f'{x:.2f}' for x in ratios)}  texts identical {same}/{total}", flush=True)
    a.out.write_text(json.dumps({"summary": summary, "per_run": [{b: {k: v['tok_s'] for k, v in r[b].items()}
                                                                  for b in r} for r in per_run]}, indent=1))


if __name__ == "__main__":
    main()
