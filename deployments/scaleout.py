"""Scale-out demo and check: a local multi-node Ray cluster, two MTP replicas, one per node.

    python -m deployments.scaleout [--json]

Builds a `ray.cluster_utils.Cluster` on this machine: a head node with no "mlx" resource and two
worker nodes with {"mlx": 1} each; deploys the app with `num_replicas=2` and
`replica_resources={"mlx": 1}` (so one replica lands on each MLX node, none on the head); sends
waves of concurrent requests with two different sampler settings (so several cohorts are in
flight at once); and reports which replica served how many cohorts. Exit status 0 when both
replicas served cohorts on two different nodes. Used by `tests/test_http.py` (marked slow).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from ._proc import free_port


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


def run(waves: int = 3, rows_per_wave: int = 16, max_tokens: int = 48) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments import build_app

    t0 = time.time()
    # (All nodes are processes on this machine. Forcing node_ip_address=127.0.0.1 makes the
    # nodes' syncer connections fail here, so the cluster uses the machine's own address; the
    # Serve proxy still listens on 127.0.0.1 only.)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={"mlx": 1}) for _ in range(2)]
    report: dict = {"ok": False}
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="mtplx-scaleout")
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"num_replicas": 2, "replica_resources": {"mlx": 1}, "replica_num_cpus": 1,
                         "blas_threads": 1, "max_concurrent_batches": 4, "batch_wait_timeout_s": 0.05,
                         # the ingress may land on the head node: get the tokenizer from a replica
                         "tokenizer_source": "replica"})
        serve.run(app, name="mtplx", route_prefix="/")
        report["startup_s"] = time.time() - t0
        base = f"http://127.0.0.1:{port}"
        by_replica: dict = {}
        for _ in range(waves):
            for resp in asyncio.run(_wave(base, rows_per_wave, max_tokens)):
                rid = resp["mtplx_stats"].get("replica_id")
                by_replica[rid] = by_replica.get(rid, 0) + 1
        snap = httpx.get(f"{base}/v1/mtplx/snapshot", timeout=60).json()
        cohorts = {rid: s.get("cohort_calls", 0) for rid, s in snap["replicas"].items()}
        nodes = {rid: s.get("node_id") for rid, s in snap["replicas"].items()}
        worker_ids = {w.node_id for w in workers}
        report.update({
            "responses_by_replica": by_replica, "cohorts_by_replica": cohorts, "replica_nodes": nodes,
            "replicas_on_mlx_nodes": all(n in worker_ids for n in nodes.values()),
            "elapsed_s": time.time() - t0,
        })
        if not all(isinstance(s, dict) and "cohort_calls" in s for s in snap["replicas"].values()):
            report["snapshot"] = snap
        report["ok"] = (len(cohorts) == 2 and all(v > 0 for v in cohorts.values())
                        and len(set(nodes.values())) == 2 and report["replicas_on_mlx_nodes"])
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
    return report


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    report = run()
    print(json.dumps(report) if "--json" in argv else json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
