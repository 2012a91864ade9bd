"""Past one machine: a multi-node Ray cluster on this machine (three nodes on loopback, two of
them with {"mlx": 1} and one model replica each), in every run.

One cluster for every check here: `python -m deployments.scaleout --json` runs in a subprocess
(a Ray of its own, on loopback, with its files in a temporary folder of its own, so it clashes
with neither the session's Ray nor any other on this machine) and reports each phase; each test
reads its phase. The phases, in order: unrelated requests and sessions spread over both
replicas; a 3-turn conversation's turns 2 and 3 find their prefix cached on turn 1's replica
(by its session, and by its prefix alone); the replicas scaled down from two to one under load;
a rolling config update under load (back to two, every replica replaced); `kill -9` of a
replica's process under 8 streaming clients; Serve's autoscaler with the rows policy, from one
replica to two under load and back to one after. Under load, every request completes with all its
tokens, and every greedy or seeded request's text equals its undisturbed text (nothing lost, nothing
repeated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster_report():
    from deployments._proc import DIRECT_HTTP_ENV

    # (without the session's direct port: its own ingress would find it taken)
    env = {k: v for k, v in os.environ.items() if k not in DIRECT_HTTP_ENV}
    out = subprocess.run([sys.executable, "-m", "deployments.scaleout", "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1500)
    # the report is its last JSON line (Ray's processes may print after it as the cluster stops)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads(lines[-1])
    print(f"scale-out cluster: {report.get('elapsed_s')} s; start-up {report.get('startup_s')} s; "
          f"phases {report.get('phases_s')}; checks {report.get('checks')}")
    return report


def _phase(report: dict, name: str) -> dict:
    assert name in report, {k: report.get(k) for k in ("checks", "phases_s", "elapsed_s")}
    assert "exception" not in report[name], report[name]
    return report[name]


def test_requests_spread_over_two_replicas_on_two_loopback_nodes(cluster_report):
    from deployments._proc import is_loopback

    r = _phase(cluster_report, "spread")
    assert not r["errors"] and not r["unattributed"], (r["errors"], r["unattributed"])
    assert len(r["plain_replicas"]) == 2 and len(r["session_replicas"]) == 2, r
    assert len(set(r["replica_nodes"].values())) == 2 and r["replicas_on_mlx_nodes"], r
    assert r["node_addresses"] and all(is_loopback(a) for a in r["node_addresses"]), r
    assert cluster_report["checks"]["spread"]


def test_a_conversations_later_turns_hit_the_cache_on_its_replica(cluster_report):
    r = _phase(cluster_report, "affinity")
    for how in ("session", "prefix"):
        turns = r[how]
        assert not any(t["error"] for t in turns), turns
        assert len({t["replica"] for t in turns}) == 1, (how, turns)
        assert all(t["cached_tokens"] >= 256 for t in turns[1:]), (how, turns)
    assert r["routing"]["decisions"].get("prefix", 0) >= 2, r["routing"]


def test_scaling_down_under_load_loses_nothing(cluster_report):
    r = _phase(cluster_report, "scale_down")
    assert not r["problems"], r["problems"]
    assert len(r["before"]) == 2 and len(r["after"]) == 1, r
    assert r["rows_moved"] >= 1 and r["row_moves_failed"] == 0, r   # the stopped replica's rows moved on
    assert r["requests"] >= 8


def test_a_rolling_config_update_under_load_loses_nothing(cluster_report):
    r = _phase(cluster_report, "rolling_update")
    assert not r["problems"], r["problems"]
    assert len(r["after"]) == 2 and not set(r["after"]) & set(r["before"]), r     # every replica replaced
    assert r["ingress_before"] == r["ingress_after"], r                          # the HTTP front stayed
    assert r["row_moves_failed"] == 0 and r["requests"] >= 8


def test_kill_9_of_a_replica_under_8_streaming_clients(cluster_report):
    r = _phase(cluster_report, "kill")
    assert not r["problems"], r["problems"]      # every stream whole; greedy and seeded texts as undisturbed
    assert r["rows_on_it"] >= 1 and r["rows_moved"] >= 1 and r["row_moves_failed"] == 0, r
    assert r["requests"] == 8


def test_serves_autoscaler_adds_a_replica_under_load_and_removes_it_after(cluster_report):
    """The rows autoscaling policy as Serve runs it: the replicas' own row counts reach the
    controller, which adds the second replica while eight rows stream on one, and removes it once
    they are done; every stream whole meanwhile."""
    r = _phase(cluster_report, "autoscale")
    assert not r["problems"], r["problems"]
    assert r["started_s"] is not None, r                     # the autoscaled app started at one replica
    assert r["scaled_up_after_s"] is not None and len(r["replicas_under_load"]) == 2, r
    assert r["scaled_down_after_s"] is not None, r
    assert r["row_moves_failed"] == 0 and r["requests"] >= 8, r
