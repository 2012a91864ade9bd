"""`bench soak`: the served app under churn and overload, as `serve run` starts it.

Two phases, each on its own `serve run` of `serve_configs/config.yaml` (a fresh local Ray, free port,
see `benchmarks.servers.start_ours`):

  * **soak** (the shipped config): REQUESTS streaming `/v1/completions` from CLIENTS closed-loop
    clients, greedy and sampled alternating by request index, `max_tokens` 8-256 (fixed per
    index), and DROP_FRACTION of the streams dropped mid-way (the client closes the connection
    after a fixed number of chunks, about a third of its budget). A kept request is *lost* unless it
    ends with `[DONE]` (after its text, or after a clean SSE error event). Afterwards the snapshot
    must show nothing left in any queue or map, and the replica's resident memory is compared with
    where it was after warm-up.
  * **overload** (a small queue: `max_waiting_rows` and `max_waiting_rows_per_key` small, few
    batch windows): OVERLOAD_CLIENTS clients in a closed loop for OVERLOAD_S seconds; a refused
    client waits its `Retry-After` and tries again. Each refusal must be 429/503 with `Retry-After`
    in OpenAI's error shape, answered within 100 ms (time to the status line); every admitted
    request must complete.

    python -m benchmarks.soak            # or: mtplx bench soak [--quick]

Writes `build/bench/soak-<stamp>.json` and the `bench:soak` section of `BENCHMARKS.md`.

Modules: `clients` (the workload and its lean HTTP/1.1 clients), `summary` (the figures and the
server's state), `cli` (both phases, the checks, the command).
"""

from benchmarks.soak.cli import bench_soak, main, run_cli
from benchmarks.soak.clients import RawConnection, raw_stream

__all__ = ["RawConnection", "bench_soak", "main", "raw_stream", "run_cli"]
