"""Scale-out demo and check: a multi-node Ray cluster on this machine, one MTP replica per MLX node.

    python -m deployments.scaleout [--json] [--only spread,affinity,scale_down,rolling_update,kill,autoscale]

Builds a `ray.cluster_utils.Cluster`: a head node with no "mlx" resource and two worker nodes
with {"mlx": 1} each; deploys the app with two replicas (`replica_resources={"mlx": 1}`: one per
MLX node, none on the head); then runs, on that one cluster, in this order:

- spread: unrelated requests (no session) and distinct sessions reach both replicas, on two
  nodes, every node on 127.0.0.1;
- affinity: a 3-turn chat conversation with a session header and one without (routed by its
  cached prefix): turns 2 and 3 reach turn 1's replica and find their prefix cached there;
- references: the greedy and seeded ones of eight requests (greedy, seeded sampled, unseeded
  sampled), undisturbed;
- scale_down: the replicas go from two to one (the config's `num_replicas` for MTPReplica) while
  those eight stream in closed loops; the stopped replica's rows move to the other past its
  grace period;
- rolling_update: a config update that changes the replicas' actor options (their environment)
  and goes back to two replicas, under the same load: every model replica is replaced, one at a
  time, and the ingress stays;
- kill: `kill -9` of the replica process holding the most rows while the eight stream;
- autoscale: the app redeployed with the rows autoscaling policy (`AUTOSCALING`: one replica to
  two, a target of 2 rows a replica) and one replica; Serve's autoscaler, fed by the replicas'
  own row counts, adds the second replica while the eight stream, and takes it away again once
  they are done.

In every loaded phase each request must complete with all its tokens, and each greedy or seeded
request's text must equal its undisturbed text: nothing lost, nothing repeated. Exit status 0 when
every check holds (`report["checks"]`). Used by `tests/test_scaleout.py`.

Every deploy goes through Serve's declarative API, as `serve run` / `serve deploy` of a config
file does (a change to a deployment's options updates that deployment alone; a change to the
application's `args` redeploys every deployment, the ingress too).

The cluster is this machine's alone: every node on loopback (`LOOPBACK_RAY_ENV`), and Ray's files
in a temporary folder of its own, so that the cluster address Ray records there for `ray.init()`
never points another `serve run` or `ray.init()` on this machine at this cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

from ._proc import LOOPBACK_RAY_ENV, free_port, is_loopback

MODEL = "mtplx-tiny-py"
PHASES = ("spread", "affinity", "scale_down", "rolling_update", "kill", "autoscale")
APP_ARGS = {"num_replicas": 2, "replica_resources": {"mlx": 1}, "replica_num_cpus": 1, "widths": [3, 8],
            "blas_threads": 1, "max_concurrent_batches": 16, "batch_wait_timeout_s": 0.05, "warmup": False,
            # a stopped replica's rows outlast this, so they move; a moving row waits for a replica this long
            "replica_graceful_shutdown_s": 0.5, "failover_timeout_s": 180.0, "summary_interval_s": 10.0,
            # the ingress may land on the head node: get the tokenizer from a replica
            "tokenizer_source": "replica"}
# the autoscale phase's policy: short windows and delays, so that Serve's autoscaler acts within seconds
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_rows_per_replica": 2,
               "look_back_period_s": 2.0, "upscale_delay_s": 0.0, "downscale_delay_s": 2.0}
# how often replicas push their autoscaling metrics to Serve's controller (Serve's default: 10 s)
METRICS_PUSH_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
# long enough that a stopped replica's rows outlast the controller's stop and its grace period (a
# row streams 200 tokens in about 4 s here: a scale-down sometimes found its rows already done)
LOAD_TOKENS = 400
# the loaded phases' requests: (prompt, settings, deterministic: its undisturbed text is its text)
LOAD = [("def fibonacci(n):", {"temperature": 0.0}, True),
        ("class Stack:", {"temperature": 0.0}, True),
        ("import os\n", {"temperature": 0.0}, True),
        ("for i in range(10):\n", {"temperature": 0.0}, True),
        ("def parse(text):", {"temperature": 0.8, "top_p": 0.95, "seed": 7}, True),
        ("while True:\n", {"temperature": 0.7, "seed": 11}, True),
        ("def main():\n", {"temperature": 0.9}, False),
        ("# utilities\n", {"temperature": 0.6, "top_k": 20}, False)]
SYSTEM = ("You are a careful Python reviewer. You read code, say what it does, point out bugs and "
          "suggest small fixes. ") * 12
TURNS = ["Review this function:\n" + "def area(r):\n    return 3.14159 * r * r\n" * 14,
         "Now this one:\n" + "def mean(xs):\n    return sum(xs) / len(xs)\n" * 14,
         "And finally:\n" + "def first(xs):\n    return xs[0] if xs else None\n" * 14]


async def stream_chat(client, body: dict, headers: Optional[dict] = None, on_text=None) -> dict:
    """One streamed chat completion: its text, finish reason, usage, stats (replica, cached
    tokens), time to first text, the longest pause between pieces of text, and an error if one
    came (status or SSE error event).
    `on_text()`: called at its first text."""
    out = {"text": "", "finish_reason": None, "usage": None, "stats": None, "error": None, "ttft_s": None,
           "max_gap_s": 0.0, "last_text_s": None}
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        if resp.status_code != 200:
            out["error"] = {"status": resp.status_code, "body": (await resp.aread()).decode()[:500]}
            return out
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                _read_chunk(json.loads(line[6:]), out, t0, on_text)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _read_chunk(obj: dict, out: dict, t0: float, on_text) -> None:
    if "error" in obj:
        out["error"] = obj["error"]
        return
    for choice in obj.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            now = time.perf_counter() - t0
            if out["ttft_s"] is None:
                out["ttft_s"] = now
                if on_text is not None:
                    on_text()
            else:        # the longest pause between two pieces of text (a row moving shows here)
                out["max_gap_s"] = max(out["max_gap_s"], now - out["last_text_s"])
            out["last_text_s"] = now
            out["text"] += piece
        out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    out["usage"] = obj.get("usage") or out["usage"]
    out["stats"] = obj.get("mtplx_stats") or out["stats"]


def _load_body(i: int, max_tokens: int = LOAD_TOKENS) -> dict:
    prompt, settings, _ = LOAD[i]
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "ignore_eos": True,
            **settings}


def _load_headers(i: int) -> dict:
    return {"x-session-id": f"load-{i}"}


def _check_load_result(i: int, res: dict, refs: Dict[int, str]) -> Optional[str]:
    """Why a loaded request's answer is wrong (None: it is whole, and its text is its undisturbed text)."""
    if res["error"] is not None or res["finish_reason"] != "length":
        return f"request {i}: {res['error'] or res['finish_reason']}"
    if (res["usage"] or {}).get("completion_tokens") != LOAD_TOKENS:
        return f"request {i}: {res['usage']} (expected {LOAD_TOKENS} completion tokens)"
    if LOAD[i][2] and res["text"] != refs.get(i):
        return f"request {i}: its text differs from its undisturbed text: {res['text']!r} vs {refs.get(i)!r}"
    return None


class App:
    """The app on a loopback cluster, from this driver: its base URL, its snapshot, a redeploy
    (`deploy`: the MTPReplica deployment's replicas and revision, the app's args over `APP_ARGS`)."""

    def __init__(self, base: str, cluster, workers: list):
        self.base = base
        self.cluster = cluster
        self.workers = workers

    def deploy(self, num_replicas: Optional[int] = 2, revision: str = "1", **args) -> None:
        _deploy_config(num_replicas, revision, {**APP_ARGS, **args})

    def snapshot(self) -> dict:
        import httpx

        return httpx.get(f"{self.base}/v1/mtplx/snapshot", timeout=60).json()

    def replicas(self) -> Dict[str, dict]:
        return {rid: s for rid, s in self.snapshot()["replicas"].items() if isinstance(s, dict) and "pid" in s}

    def ingress(self) -> dict:
        return self.snapshot()["ingress"]


def _replica_of(res: dict) -> Optional[str]:
    return (res["stats"] or {}).get("replica_id")


async def _spread(app: App) -> dict:
    """Unrelated prompts without a session (one batch window each), and eight sessions at once."""
    import httpx

    async with httpx.AsyncClient(base_url=app.base, timeout=300) as client:
        plain = []
        for i in range(8):
            plain.append(asyncio.ensure_future(stream_chat(client, _load_body(i, 24))))
            await asyncio.sleep(0.3)
        plain = await asyncio.gather(*plain)
        sessions = await asyncio.gather(*[stream_chat(client, _load_body(i, 8), headers={"x-session-id": f"s-{i}"})
                                          for i in range(8)])
    return {"plain_replicas": sorted({str(_replica_of(r)) for r in plain}),
            "session_replicas": sorted({str(_replica_of(r)) for r in sessions}),
            "errors": [r["error"] for r in plain + sessions if r["error"]],
            # a request that ended without naming its replica (no stats chunk) is a problem too
            "unattributed": [{k: r[k] for k in ("finish_reason", "usage", "stats", "text")}
                             for r in plain + sessions if _replica_of(r) is None and not r["error"]]}


async def _conversation(client, session: Optional[str], n: int) -> List[dict]:
    """A chat of three turns, each turn's prompt the last one's plus its answer and a new question."""
    messages = [{"role": "system", "content": f"(conversation {n}) " + SYSTEM}]
    turns = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        res = await stream_chat(client, {"messages": messages, "max_tokens": 12, "temperature": 0.0},
                                headers={"x-session-id": session} if session else None)
        usage = res["usage"] or {}
        turns.append({"replica": _replica_of(res), "error": res["error"], "prompt_tokens": usage.get("prompt_tokens"),
                      "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
        messages.append({"role": "assistant", "content": res["text"]})
    return turns


async def _affinity(app: App) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=app.base, timeout=300) as client:
        with_session = await _conversation(client, "affinity-conversation", 1)
        by_prefix = await _conversation(client, None, 2)
    return {"session": with_session, "prefix": by_prefix, "routing": app.ingress()["routing"]}


def _affinity_ok(r: dict) -> bool:
    def kept(turns):
        return (not any(t["error"] for t in turns) and len({t["replica"] for t in turns}) == 1
                and all((t["cached_tokens"] or 0) >= 256 for t in turns[1:]))

    return kept(r["session"]) and kept(r["prefix"]) and r["routing"]["decisions"].get("prefix", 0) >= 2


async def references(app: App) -> Dict[int, str]:
    """Each deterministic loaded request's text, undisturbed: sent together, with no replica
    going away (a greedy or seeded row's text does not depend on the rows beside it)."""
    import httpx

    wanted = [i for i, (_, _, deterministic) in enumerate(LOAD) if deterministic]
    async with httpx.AsyncClient(base_url=app.base, timeout=300) as client:
        results = await asyncio.gather(*[stream_chat(client, _load_body(i), headers=_load_headers(i)) for i in wanted])
    return {i: res["text"] if res["error"] is None and res["finish_reason"] == "length" else None
            for i, res in zip(wanted, results)}


async def _closed_loops(app: App, refs: Dict[int, str], until: threading.Event, streaming: threading.Event) -> dict:
    """The eight loaded requests, each in a closed loop until `until` is set (each loop ends with
    the request it has in flight); `streaming` is set once every loop's first request streams.
    Returns the problems (`_check_load_result`), how many deterministic texts equal their text
    undisturbed, the completion tokens against those asked for, and the longest pause in a stream."""
    import httpx

    results: List[tuple] = []
    texting: set = set()

    def first_text(i):
        texting.add(i)
        if len(texting) == len(LOAD):
            streaming.set()

    async def loop(client, i):
        while True:
            res = await stream_chat(client, _load_body(i), headers=_load_headers(i), on_text=lambda: first_text(i))
            results.append((i, res))
            if until.is_set():
                return

    async with httpx.AsyncClient(base_url=app.base, timeout=900) as client:
        await asyncio.gather(*[loop(client, i) for i in range(len(LOAD))])
    streaming.set()
    problems = [p for i, res in results if (p := _check_load_result(i, res, refs)) is not None]
    deterministic = [(i, res) for i, res in results if LOAD[i][2]]
    return {"requests": len(results), "problems": problems, "deterministic": len(deterministic),
            "identical": sum(res["text"] == refs.get(i) for i, res in deterministic),
            "completion_tokens": sum((res["usage"] or {}).get("completion_tokens") or 0 for _, res in results),
            "expected_tokens": LOAD_TOKENS * len(results),
            "longest_pause_s": max((res["max_gap_s"] for _, res in results), default=0.0)}


def under_load(app: App, refs: Dict[int, str], disrupt: Callable[[], dict], once: bool = False) -> dict:
    """The closed loops, `disrupt()` once every first request streams, then the loops' last
    requests (`once`: each loop sends one request only)."""
    until, streaming, out = threading.Event(), threading.Event(), {}
    if once:
        until.set()
    moved_before = app.ingress()
    loops = threading.Thread(target=lambda: out.update(asyncio.run(_closed_loops(app, refs, until, streaming))))
    loops.start()
    streaming.wait(600)
    t0 = time.time()
    out.update(disrupt())
    out["disrupt_s"] = time.time() - t0
    until.set()
    loops.join(1200)
    after = app.ingress()
    out["rows_moved"] = after["rows_moved"] - moved_before["rows_moved"]
    out["row_moves_failed"] = after["row_moves_failed"] - moved_before["row_moves_failed"]
    return out


def kill_busiest(app: App) -> dict:
    """kill -9 the process of the replica holding the most of this ingress's rows."""
    replicas = app.replicas()
    in_flight = app.ingress()["routing"]["rows_in_flight"]
    victim = max(replicas, key=lambda r: (in_flight.get(r, 0), r))
    pid = replicas[victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    return {"killed": victim, "killed_pid": pid, "rows_on_it": in_flight.get(victim, 0)}


def _ingress_actors() -> list:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "OpenAIIngress" in a["name"])


def _run_phases(app: App, report: dict, only, t0: float) -> None:
    app.deploy(num_replicas=2)
    report["startup_s"] = time.time() - t0
    checks = report["checks"]

    def phase(name, fn):
        if name in only:
            t = time.time()
            try:
                report[name] = fn()
                checks[name] = PHASE_CHECKS[name](report[name])
            except Exception as e:      # one phase's fault is reported; the later phases still run
                report[name] = {"exception": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                checks[name] = False
            report["phases_s"][name] = round(time.time() - t, 1)

    phase("spread", lambda: _spread_report(app))
    phase("affinity", lambda: asyncio.run(_affinity(app)))
    refs = asyncio.run(references(app)) if set(only) & {"scale_down", "rolling_update", "kill", "autoscale"} else {}
    report["references"] = {i: (t or "")[:40] for i, t in refs.items()}
    phase("scale_down", lambda: _config_update(app, refs, {"num_replicas": 1}, replicas=1))
    phase("rolling_update", lambda: _config_update(app, refs, {"num_replicas": 2, "revision": "2"}, replicas=2))
    phase("kill", lambda: under_load(app, refs, lambda: kill_busiest(app), once=True))
    report["ingress"] = app.ingress()
    phase("autoscale", lambda: _autoscale(app, refs))


def _wait_for_replicas(app: App, count: int, timeout_s: float, gone=()) -> Optional[float]:
    """Seconds until `count` model replicas serve, none of them one of `gone`; None if they did
    not within `timeout_s`."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        now = app.replicas()
        if len(now) == count and not set(now) & set(gone):
            return round(time.time() - t0, 1)
        time.sleep(0.5)
    return None


def _autoscale(app: App, refs: Dict[int, str]) -> dict:
    """Redeploy with the rows autoscaling policy at one replica; under the eight streams, Serve's
    autoscaler must add the second; once they end, take it away."""
    app.deploy(num_replicas=None, autoscaling=AUTOSCALING)     # new args: every deployment anew
    started = _wait_for_replicas(app, 1, 300)
    out = under_load(app, refs, lambda: {"scaled_up_after_s": _wait_for_replicas(app, 2, 180)})
    out.update(started_s=started, replicas_under_load=sorted(app.replicas()),
               scaled_down_after_s=_wait_for_replicas(app, 1, 120))
    return out


def _scale_down_ok(r: dict) -> bool:
    return not r["problems"] and len(r["after"]) == 1 and r["rows_moved"] >= 1


def _rolling_update_ok(r: dict) -> bool:
    return (not r["problems"] and len(r["after"]) == 2 and not set(r["after"]) & set(r["before"])
            and r["ingress_before"] == r["ingress_after"])


def _kill_ok(r: dict) -> bool:
    return not r["problems"] and r["rows_moved"] >= 1 and r["row_moves_failed"] == 0


def _autoscale_ok(r: dict) -> bool:
    return (not r["problems"] and r["started_s"] is not None and r["scaled_up_after_s"] is not None
            and r["scaled_down_after_s"] is not None and r["row_moves_failed"] == 0)


def _deploy_config(num_replicas: Optional[int], revision: str, args: dict, timeout_s: float = 600.0) -> None:
    """Deploy the app with these args, `num_replicas` MTPReplicas and `revision` (an environment
    variable of their actors: a new value replaces every replica), as `serve deploy` of a config
    file does; wait until it runs. Options of one deployment change that deployment alone; a
    change of `args` redeploys every deployment, the ingress too."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    actor = {"num_cpus": args["replica_num_cpus"], "num_gpus": 0, "resources": args["replica_resources"],
             "runtime_env": {"env_vars": {"MTPLX_SCALEOUT_REVISION": revision, **METRICS_PUSH_ENV}}}
    replica = {"name": "MTPReplica", "ray_actor_options": actor}
    if num_replicas is not None:          # None: the app's autoscaling config decides
        replica["num_replicas"] = num_replicas
    config = {"applications": [{
        "name": "mtplx", "route_prefix": "/", "import_path": "deployments:build_app", "args": args,
        "deployments": [replica]}]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    deadline = time.time() + timeout_s
    time.sleep(1.0)
    while time.time() < deadline:
        status = serve.status().applications.get("mtplx")
        if status is not None and status.status == "RUNNING" and all(
                d.status == "HEALTHY" for d in status.deployments.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the app did not run within {timeout_s:g} s: {serve.status()}")


def _config_update(app: App, refs: Dict[int, str], changes: dict, replicas: int) -> dict:
    """A config update under load, until `replicas` replicas serve (and, with a new revision, none
    of the old ones): the replicas before and after, the ingress actor unchanged."""
    before, ingress_before = sorted(app.replicas()), _ingress_actors()

    def update() -> dict:
        in_flight = app.ingress()["routing"]["rows_in_flight"]
        app.deploy(**changes)
        # until the replicas are the new set, the old ones gone
        _wait_for_replicas(app, replicas, 600, gone=before if "revision" in changes else ())
        return {"rows_in_flight_before": in_flight}

    out = under_load(app, refs, update)
    out.update(before=before, after=sorted(app.replicas()), ingress_before=ingress_before,
               ingress_after=_ingress_actors())
    return out


def _spread_report(app: App) -> dict:
    import ray

    out = asyncio.run(_spread(app))
    replicas = app.replicas()
    mlx_nodes = {w.node_id for w in app.workers}
    out.update({"replica_nodes": {rid: s.get("node_id") for rid, s in replicas.items()},
                "replicas_on_mlx_nodes": all(s.get("node_id") in mlx_nodes for s in replicas.values()),
                "node_addresses": sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}),
                "gcs_address": app.cluster.address})
    return out


def _spread_ok(r: dict) -> bool:
    """Both replicas served, each on its own MLX node, and every node is on loopback."""
    return (not r["errors"] and not r["unattributed"]
            and len(r["plain_replicas"]) == 2 and len(r["session_replicas"]) == 2
            and len(set(r["replica_nodes"].values())) == 2 and r["replicas_on_mlx_nodes"]
            and all(is_loopback(a) for a in r["node_addresses"]) and is_loopback(r["gcs_address"].rsplit(":", 1)[0]))


PHASE_CHECKS = {"spread": _spread_ok, "affinity": _affinity_ok, "scale_down": _scale_down_ok,
                "rolling_update": _rolling_update_ok, "kill": _kill_ok, "autoscale": _autoscale_ok}


def _ray_on_loopback():
    """Ray, imported after its environment is set: every node on loopback, no usage reports. Refused
    where this process imported Ray before (its nodes would take the machine's network address)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.update(LOOPBACK_RAY_ENV)
    import ray

    if not is_loopback(ray.util.get_node_ip_address()):
        raise RuntimeError("Ray was imported before this demo set its environment: its nodes would listen on "
                           f"{ray.util.get_node_ip_address()}; run it in a process of its own "
                           "(python -m deployments.scaleout)")
    return ray


@contextlib.contextmanager
def loopback_cluster(mlx_nodes: int = 2):
    """A Ray cluster on this machine: a head node with no "mlx" resource and `mlx_nodes` worker
    nodes with {"mlx": 1} each, every node on loopback, Ray's files in a temporary folder of its
    own, Serve's HTTP on a free port; yields the `App` (not deployed yet). Everything it started
    is shut down on exit."""
    ray = _ray_on_loopback()
    from ray import serve
    from ray.cluster_utils import Cluster

    ray_tmp = tempfile.mkdtemp(prefix="mtplx-so-", dir="/tmp")     # short: Ray's socket paths
    os.environ["RAY_TMPDIR"] = ray_tmp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"mlx": 1}) for _ in range(mlx_nodes)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="mtplx-scaleout")
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield App(f"http://127.0.0.1:{port}", cluster, workers)
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


def run(only=PHASES) -> dict:
    t0 = time.time()
    report: dict = {"ok": False, "checks": {}, "phases_s": {}}
    try:
        with loopback_cluster() as app:
            _run_phases(app, report, only, t0)
        report["ok"] = bool(report["checks"]) and all(report["checks"].values())
    finally:
        report["elapsed_s"] = round(time.time() - t0, 1)
    return report


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = PHASES
    if "--only" in argv:
        only = tuple(argv[argv.index("--only") + 1].split(","))
    report = run(only)
    print(json.dumps(report, default=str) if "--json" in argv else json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
