"""Scale-out demo and check: a local multi-node Ray cluster, two MTP replicas, one per node.

    python -m deployments.scaleout [--json]

Builds a `ray.cluster_utils.Cluster` on this machine: a head node with no "mlx" resource and two
worker nodes with {"mlx": 1} each; deploys the app with `num_replicas=2` and
`replica_resources={"mlx": 1}` (so one replica lands on each MLX node, none on the head); sends
waves of concurrent requests with two different sampler settings (so several cohorts are in
flight at once); and reports which replica served how many cohorts and the nodes' addresses. Exit
status 0 when both replicas served cohorts on two different nodes, every node on 127.0.0.1. Used
by `tests/test_http.py`.

The cluster is this machine's alone: every node on loopback (`LOOPBACK_RAY_ENV`), and Ray's files
in a temporary folder of its own, so that the cluster address Ray records there for `ray.init()`
never points another `serve run` or `ray.init()` on this machine at this cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

from ._proc import LOOPBACK_RAY_ENV, free_port, is_loopback


async def _wave(base: str, n: int, max_tokens: int) -> list:
    import httpx

    prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):\n"]

    async def one(client, i):
        body = {"model": "mtplx-tiny-py", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "temperature": 0.0 if i % 2 == 0 else 0.7, "max_tokens": max_tokens, "seed": i}
        r = await client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()

    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        return await asyncio.gather(*[one(client, i) for i in range(n)])


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


def _serve_waves(cluster, t0: float, waves: int, rows_per_wave: int, max_tokens: int) -> dict:
    """Deploy the app on the cluster (started at `t0`), send the waves; the report's figures."""
    import httpx
    import ray
    from ray import serve

    from deployments import build_app

    ray.init(address=cluster.address, log_to_driver=False, namespace="mtplx-scaleout")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # (lanes up to B8 show the spread as well; B16 and B32 would only add start-up time, each
    # installed and warmed up on a shared core; rows beyond a full B8 wait for a slot)
    app = build_app({"num_replicas": 2, "replica_resources": {"mlx": 1}, "replica_num_cpus": 1, "widths": [3, 8],
                     "blas_threads": 1, "max_concurrent_batches": 4, "batch_wait_timeout_s": 0.05,
                     # the ingress may land on the head node: get the tokenizer from a replica
                     "tokenizer_source": "replica"})
    serve.run(app, name="mtplx", route_prefix="/")
    report = {"startup_s": time.time() - t0}
    base = f"http://127.0.0.1:{port}"
    by_replica: dict = {}
    for _ in range(waves):
        for resp in asyncio.run(_wave(base, rows_per_wave, max_tokens)):
            rid = resp["mtplx_stats"].get("replica_id")
            by_replica[rid] = by_replica.get(rid, 0) + 1
    snap = httpx.get(f"{base}/v1/mtplx/snapshot", timeout=60).json()
    if not all(isinstance(s, dict) and "cohort_calls" in s for s in snap["replicas"].values()):
        report["snapshot"] = snap
    report.update({
        "responses_by_replica": by_replica,
        "cohorts_by_replica": {rid: s.get("cohort_calls", 0) for rid, s in snap["replicas"].items()},
        "replica_nodes": {rid: s.get("node_id") for rid, s in snap["replicas"].items()},
        "node_addresses": sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}),
        "gcs_address": cluster.address,
    })
    return report


def _ok(report: dict) -> bool:
    """Both replicas served cohorts, each on its own MLX node, and every node is on loopback."""
    cohorts, nodes = report["cohorts_by_replica"], report["replica_nodes"]
    return (len(cohorts) == 2 and all(v > 0 for v in cohorts.values()) and len(set(nodes.values())) == 2
            and report["replicas_on_mlx_nodes"] and all(is_loopback(a) for a in report["node_addresses"])
            and is_loopback(report["gcs_address"].rsplit(":", 1)[0]))


def run(waves: int = 3, rows_per_wave: int = 16, max_tokens: int = 48) -> dict:
    ray = _ray_on_loopback()
    from ray import serve
    from ray.cluster_utils import Cluster

    ray_tmp = tempfile.mkdtemp(prefix="mtplx-so-", dir="/tmp")     # short: Ray's socket paths
    os.environ["RAY_TMPDIR"] = ray_tmp
    t0 = time.time()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={"mlx": 1}) for _ in range(2)]
    report: dict = {"ok": False}
    try:
        cluster.wait_for_nodes()
        report.update(_serve_waves(cluster, t0, waves, rows_per_wave, max_tokens))
        mlx_nodes = {w.node_id for w in workers}
        report["replicas_on_mlx_nodes"] = all(n in mlx_nodes for n in report["replica_nodes"].values())
        report["elapsed_s"] = time.time() - t0
        report["ok"] = _ok(report)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    return report


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    report = run()
    print(json.dumps(report) if "--json" in argv else json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
