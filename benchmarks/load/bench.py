"""`bench_load`: the runs of the comparison, each the peer's turn then ours (see the package's
docstring), and the record they make."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from benchmarks.load.arms import run_logprob_arms, run_mode_arms, run_turn
from benchmarks.load.summary import (identical_by_arm, summarize_logprobs, summarize_mixed, summarize_modes,
                                     summarize_runs)
from benchmarks.load.workload import (CAPACITY_CLIENTS, DEFAULT_CLIENTS, DEFAULT_TEMPERATURES, OPEN_LOOP_LOAD,
                                      arm_label, closed_loop_requests)
from benchmarks.report import ROOT, machine_info
from benchmarks.servers import SHIPPED_MODEL, make_peer_checkpoint, start_ours, start_peer
from mtplx.models.registry import check_installed


def bench_load(model_dir: Optional[str] = None, runs: int = 3, clients: Iterable[int] = DEFAULT_CLIENTS,
               temperatures: Iterable[float] = DEFAULT_TEMPERATURES, per_client: int = 6, min_requests: int = 12,
               open_requests: int = 48, seed: int = 0, ready_timeout_s: float = 600.0,
               modes: Iterable[str] = (), logprobs: Optional[int] = None, direct_http: bool = False,
               long_prompt_tokens: Optional[int] = None, config: Optional[str] = None,
               generation_mode: Optional[str] = None,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Run the comparison (see the module docstring); returns the JSON-able record."""
    started = time.time()
    clients = sorted(set(int(c) for c in clients))
    temperatures = list(temperatures)
    capacity_clients = min(clients, key=lambda c: (abs(c - CAPACITY_CLIENTS), c))
    # a directory, or an installed model's name (as a config's model_path takes it)
    model_path = Path(check_installed(model_dir)).resolve() if model_dir else None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "build" / "bench"
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    plan = {"clients": clients, "temperatures": temperatures, "per_client": per_client,
            "min_requests": min_requests, "open_requests": open_requests, "seed": seed,
            "capacity_clients": capacity_clients, "modes": list(modes), "logprobs": logprobs,
            "direct_http": direct_http, "long_prompt_tokens": long_prompt_tokens, "config": config,
            "generation_mode": generation_mode}
    record = {"bench": "load", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "model": str(model_path) if model_path else "shipped", "runs": runs, "plan": plan,
              "requests_per_arm": {**{f"closed-{n}": closed_loop_requests(n, per_client, min_requests)
                                      for n in clients}, "open": open_requests},
              "open_loop": {"load_fraction": OPEN_LOOP_LOAD, "capacity_clients": capacity_clients},
              "machine": machine_info(),
              "per_run": []}
    with tempfile.TemporaryDirectory(prefix="mtplx-bench-load-") as tmp:
        work = Path(tmp)
        peer_model = work / "peer-model"
        record["peer_checkpoint"] = make_peer_checkpoint(model_path or SHIPPED_MODEL, peer_model)
        for run in range(runs):
            result = {"run": run}
            log(f"run {run + 1}/{runs}: peer (mlx_lm.server)")
            peer = start_peer(peer_model, max(clients), out_dir / "logs" / f"load-{stamp}-peer-{run}.log",
                              ready_timeout_s)
            try:
                p = run_turn(peer, plan, run, {}, send_seed=False, log=log)
                result["peer_peak_memory_mb"] = peer.peak_memory_mb()
            finally:
                result["peer_stop"] = peer.stop()
            record["peer"] = peer.info
            log(f"run {run + 1}/{runs}: ours (serve run)")
            ours = start_ours(model_path, out_dir / "logs" / f"load-{stamp}-ours-{run}.log", work, ready_timeout_s,
                              direct_http=direct_http, config=Path(config).resolve() if config else None,
                              args_overrides={"default_generation_mode": generation_mode} if generation_mode else None)
            try:
                o = run_turn(ours, plan, run, p["rates"], send_seed=True, log=log)
                if plan["modes"]:
                    result["ours_modes"] = run_mode_arms(ours, plan, run, log)
                if plan["logprobs"] is not None:
                    result["ours_logprobs"] = run_logprob_arms(ours, plan, run, log)
                result["ours_peak_memory_mb"] = ours.peak_memory_mb()
            finally:
                result["ours_stop"] = ours.stop()
            record["ours"] = ours.info
            result.update(peer=p["arms"], ours=o["arms"], open_rate_req_s={arm_label(t): r for t, r in p["rates"].items()},
                          identical=identical_by_arm(o["rows"], p["rows"]),
                          loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
            record["per_run"].append(result)
    record["summary"] = summarize_runs(record["per_run"])
    record["peak_memory_mb"] = {side: max((r[f"{side}_peak_memory_mb"] or {}).get("largest_process", 0)
                                          for r in record["per_run"]) or None for side in ("ours", "peer")}
    record["mixed"] = summarize_mixed(record["summary"])
    record["modes"] = summarize_modes(record["per_run"])
    record["logprobs"] = summarize_logprobs(record["per_run"])
    record["elapsed_s"] = time.time() - started
    record["artifacts"] = {"json": str(out_dir / f"load-{stamp}.json"),
                           "logs": str(out_dir / "logs" / f"load-{stamp}-*.log")}
    return record
