"""`bench load`: our Serve app against `mlx_lm.server`, on the same weights, as a user meets them.

Each server runs as its own process tree, never both at once:
  * ours: `serve run` of a copy of `serve_configs/config.yaml` (free HTTP port, optional
    `model_path`), on a fresh local Ray (`--address local`, private `RAY_TMPDIR`);
  * the peer: `mlx_lm.server` on a copy of the checkpoint without its `mtp.*` tensors (mlx-lm's
    qwen3 class refuses them) and without `mtp_num_hidden_layers`, with the same OpenBLAS
    preloaded and `--decode-concurrency` / `--prompt-concurrency` set to the largest client count
    of the run. Those flags only cap the peer's running batch; a closed loop of N clients never
    has more than N requests in flight, so one start with the largest N serves every closed-loop
    arm exactly as a start with N would, and the server stays up for its whole turn.

Workload (deterministic per request index, identical for both servers): Python-code prompts,
every 5th about 6x longer than the others; `max_tokens` spread over 16-256; streaming
`POST /v1/completions` with `stream_options.include_usage`. Arms, per temperature (greedy, and
0.6 with top_p 0.95 / top_k 20 sent explicitly to both), and the mixed-settings arm `mixed`:
closed loops at each client count, then an open loop of Poisson arrivals at 70% of the peer's
closed-loop request rate (of that arm) at 8 clients in the same run. `--temperatures 0,1.0` picks
other arms, `--temperatures 0.6,mixed` some of the default ones (the default is `0,0.6,mixed`).
Sampled requests carry a per-request `seed` to ours only: `mlx_lm.server` serves any request that
has a `seed` on its sequential path, not in its batch, which would bench its fallback instead of
its batching; greedy requests carry none.

The mixed arm gives each request its own settings, the same for both servers: request i sends
one of the 15 pairs of a temperature (0, 0.2, 0.6, 0.7, 1.0) and a top_p (1.0, 0.95, 0.9), each
pair once in every block of 15 requests (`workload.mixed_settings`; greedy requests send their top_p too),
with the t0.6 arm's `top_k` 20. Its prompts and `max_tokens` are those of the other arms by
request index; its long prompts meet every pair. Issue targets: at 8 clients, lane rows per cycle >= 7,
tok/s >= 0.95x ours on the t0.6 arm (mixed/shared) and >= 1.2x the peer; at 16 clients >= 1.15x
the peer; the shared-setting arms (greedy, t0.6 at 1 and 8 clients) no slower than before.

Runs alternate peer, ours, peer, ours, ...: each run starts with the peer so that the open-loop
rate of that run is known before either server needs it. Every figure is the median over runs;
the tok/s ratio is the median of the per-run ratios ours/peer.

Per server and arm: completion tok/s (usage completion tokens / arm wall time), TTFT p50/p95
(first non-empty text chunk), ITL p50/p95 (per request, (last chunk - first chunk) /
(completion tokens - 1), so a chunk holding several tokens counts per token; raw chunk-gap
p50/p95 are in the JSON too), end-to-end p95, errors, and for ours the mean live rows per decode
cycle (delta `lane_row_cycles` / delta `lane_cycles`, summed over replicas, from
`/v1/mtplx/snapshot` around the arm; null when the counters are absent), the drafts per drafting
row-cycle (delta `draft_tokens` / delta `draft_proposals`: the lanes' depth mix as the arm met it)
and the share of those drafts accepted (delta `accepted_draft_tokens` / delta `draft_tokens`). Greedy arms also count
identical completion texts between the servers per request index, and so does the mixed arm over
its temperature-0 requests only. The mixed arm's closed loops add, in a table of their own (JSON
`mixed`), mixed/shared: the median of the per-run ratios of ours' mixed-arm tok/s over ours'
t0.6-arm tok/s at the same client count (null without a t0.6 arm), and the same for the peer.

    python -m benchmarks.load --quick          # or: mtplx bench load --quick

Writes `build/bench/load-<stamp>.json`, `docs/bench_load.png` and the `bench:load` section of
`BENCHMARKS.md`; a run with `--modes`, `--logprobs` or `--model`, or with other arms or only some
of the default ones (`--temperatures 0,0.6` lacks `mixed`), or other client counts, writes a
section and chart of its own instead (`bench:load-modes`, `bench:load-greedy-t06`,
`docs/bench_load_modes.png`, ...; see `outputs.section_name`), leaving the default comparison.

`--generation-mode ar` (or `mtp`, `auto`) serves ours with that `default_generation_mode`, every
arm in it: our AR lanes against the peer's continuous batching (section `bench:load-ar`, ...).

`--modes auto,mtp,ar` adds, for ours only, every closed-loop arm (the mixed one included when it
is planned) twice per `generation_mode`
(in a rotation turned per arm and run, then its reverse, so that drift weighs on every mode alike;
each mode's figures pool both halves; at one client the modes take turns request by request
instead), and a table of each mode's tok/s
with the medians of the per-run ratios auto/ar and auto/mtp and the largest drop of auto's tok/s
from one client count to the next (issue 14's targets: auto >= 0.97x AR where the head never
agrees, >= 0.98x MTP where it pays, no drop over 5%).

`--logprobs K` adds, for ours only, every closed-loop arm with and without `logprobs: K` (twice
each, off, on, on, off, reversed per arm and run; at one client request by request), and a table
of both tok/s and the median of the per-run ratios with/without (issue 15's target: logprobs cost
at most 10% of tok/s at 8 clients).

Modules: `workload` (what is sent), `clients` (closed and open loops), `arms` (the arms against one
running server), `bench` (the runs), `summary` (the figures), `outputs` (tables, chart, section),
`cli` (the command); the servers themselves are `benchmarks.servers`.
"""

from benchmarks.load.bench import bench_load
from benchmarks.load.cli import main, run_cli
from benchmarks.load.outputs import format_logprobs_table, format_modes_table
from benchmarks.load.summary import summarize_logprobs, summarize_modes

__all__ = ["bench_load", "format_logprobs_table", "format_modes_table", "main", "run_cli", "summarize_logprobs",
           "summarize_modes"]
