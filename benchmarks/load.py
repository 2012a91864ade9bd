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
pair once in every block of 15 requests (`mixed_settings`; greedy requests send their top_p too),
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
`/v1/mtplx/snapshot` around the arm; null when the counters are absent). Greedy arms also count
identical completion texts between the servers per request index, and so does the mixed arm over
its temperature-0 requests only. The mixed arm's closed loops add, in a table of their own (JSON
`mixed`), mixed/shared: the median of the per-run ratios of ours' mixed-arm tok/s over ours'
t0.6-arm tok/s at the same client count (null without a t0.6 arm), and the same for the peer.

    python -m benchmarks.load --quick          # or: mtplx bench load --quick

Writes `build/bench/load-<stamp>.json`, `docs/bench_load.png` and the `bench:load` section of
`BENCHMARKS.md`; a run with `--modes`, `--logprobs` or `--model`, or with other arms or only some
of the default ones (`--temperatures 0,0.6` lacks `mixed`), or other client counts, writes a
section and chart of its own instead (`bench:load-modes`, `bench:load-greedy-t06`,
`docs/bench_load_modes.png`, ...; see `section_name`), leaving the default comparison.

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
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Union

from benchmarks.report import machine_info, replace_section

from deployments._proc import DIRECT_HTTP_ENV, direct_http_env, free_port

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "mtplx" / "assets" / "mtplx-tiny-py"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

# Short prompts: the opening lines of a Python function or class, for the model to continue.
SNIPPETS = (
    "import os\nimport sys\n\n\ndef walk_files(root, suffix='.py'):\n"
    "    \"\"\"Yield the paths under root whose names end with suffix.\"\"\"\n    for dirpath, dirnames, filenames in",
    "class LRUCache:\n    \"\"\"A mapping that forgets the least recently used key.\"\"\"\n\n"
    "    def __init__(self, maxsize=128):\n        self.maxsize = maxsize\n        self.data =",
    "def parse_header(line):\n    \"\"\"Split a 'Key: value' header line into a (key, value) pair.\"\"\"\n"
    "    if ':' not in line:\n        raise ValueError('not a header: %r' % (line,))\n    key, value =",
    "import re\n\n_word = re.compile(r'\\w+')\n\n\ndef count_words(text):\n"
    "    \"\"\"Return a dict mapping each word in text to its count.\"\"\"\n    counts = {}\n    for",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):\n"
    "        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n    def pop(self):",
    "def read_config(path, defaults=None):\n    \"\"\"Read an INI file and return a dict of its sections.\"\"\"\n"
    "    import configparser\n    parser = configparser.ConfigParser()\n    parser.read(path)\n    result =",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"
    "    if n < 0:\n        raise ValueError('n must be non-negative')\n    a, b = 0, 1\n    for",
    "    def __repr__(self):\n        \"\"\"Return a string that shows the class name and fields.\"\"\"\n"
    "        args = ', '.join('%s=%r' % (k, v) for k, v in sorted(self.__dict__.items()))\n        return",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef dump_state(obj, path):\n"
    "    \"\"\"Write obj to path as JSON, atomically.\"\"\"\n    tmp = path + '.tmp'\n    with open(tmp, 'w') as f:",
    "if __name__ == '__main__':\n    import argparse\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    "    parser.add_argument('paths', nargs='*')\n    args = parser.parse_args()\n    for path in",
)
LONG_EVERY = 5          # every 5th request (index % 5 == 4) carries a long prompt
LONG_FACTOR = 6         # ... made of 6 snippets
MIN_TOKENS, MAX_TOKENS = 16, 256
SAMPLED = {"top_p": 0.95, "top_k": 20}   # sent explicitly to both servers at temperature > 0
OPEN_LOOP_LOAD = 0.7    # open-loop arrival rate as a fraction of the peer's capacity ...
CAPACITY_CLIENTS = 8    # ... measured as its closed-loop request rate at this client count
DEFAULT_CLIENTS = (1, 8, 16, 32)      # closed-loop client counts of the default comparison
MIXED = "mixed"         # the mixed-settings arm, as it stands in a list of temperatures and as its label
MIXED_TEMPERATURES = (0.0, 0.2, 0.6, 0.7, 1.0)   # the mixed arm's requests: each pair of a temperature ...
MIXED_TOP_PS = (1.0, 0.95, 0.9)                  # ... and a top_p once in every 15 (`mixed_settings`)
SHARED_TEMPERATURE = 0.6   # the arm of one shared sampled setting that the mixed arm is measured against
DEFAULT_TEMPERATURES = (0.0, 0.6, MIXED)         # its arms: greedy, t0.6, mixed settings

Arm = Union[float, str]   # a temperature, or MIXED


# ----------------------------------------------------------------------------------------------
# Workload


def prompt_for(index: int) -> str:
    """The prompt of request `index`: one snippet, or LONG_FACTOR consecutive snippets joined
    (rotated by index, so long prompts differ from each other) for every LONG_EVERY-th request."""
    n = len(SNIPPETS)
    if index % LONG_EVERY == LONG_EVERY - 1:
        return "\n\n\n".join(SNIPPETS[(index + k) % n] for k in range(LONG_FACTOR))
    return SNIPPETS[index % n]


def budget_for(index: int) -> int:
    """`max_tokens` of request `index`: 16..256, a fixed permutation (97 is coprime to 241), so
    any run of consecutive indices spreads over the whole range."""
    span = MAX_TOKENS - MIN_TOKENS + 1
    return MIN_TOKENS + (index * 97) % span


def mixed_settings(index: int) -> tuple:
    """(temperature, top_p) of request `index` of the mixed arm: pair j = (i + i // 15) % 15 of
    the 15 (temperature j // 3, top_p j % 3), so each pair occurs once in every block of 15
    requests, and the order turns by one from block to block, so that the long prompts (every
    LONG_EVERY-th request) meet every pair."""
    n = len(MIXED_TEMPERATURES) * len(MIXED_TOP_PS)
    j = (index + index // n) % n
    return MIXED_TEMPERATURES[j // len(MIXED_TOP_PS)], MIXED_TOP_PS[j % len(MIXED_TOP_PS)]


def request_body(index: int, temperature: Arm, model: str, send_seed: bool, seed_base: int = 1000) -> dict:
    """The streaming /v1/completions body of request `index` of the arm at `temperature`: greedy
    at 0, SAMPLED's top_p / top_k above 0; MIXED is the mixed arm (`mixed_settings`: its own
    temperature and top_p, with SAMPLED's top_k, always sent). A sampled request carries `seed` when
    `send_seed` (ours); a greedy one never does."""
    if temperature == MIXED:
        t, top_p = mixed_settings(index)
        sampling = {"temperature": t, "top_p": top_p, "top_k": SAMPLED["top_k"]}
    else:
        t = temperature
        sampling = {"temperature": t, **(SAMPLED if t > 0 else {})}
    body = {"model": model, "prompt": prompt_for(index), "max_tokens": budget_for(index), **sampling,
            "stream": True, "stream_options": {"include_usage": True}}
    if t > 0 and send_seed:
        body["seed"] = seed_base + index
    return body


def parse_temperatures(text: str) -> List[Arm]:
    """`--temperatures`: comma-separated numbers (0 is greedy) and the word `mixed`."""
    out: List[Arm] = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == MIXED:
            out.append(MIXED)
            continue
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--temperatures: {item!r} is neither a number nor {MIXED!r}") from None
    return out


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> List[float]:
    """Send times (s from the arm's start) of n Poisson arrivals at rate_rps, from a seeded RNG
    so both servers meet the same schedule."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        out.append(t)
    return out


def closed_loop_requests(clients: int, per_client: int, minimum: int) -> int:
    """Requests in a closed-loop arm: per_client per client, at least `minimum`."""
    return max(minimum, per_client * clients)


# ----------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Iterable[Optional[float]], q: float) -> Optional[float]:
    """q-th percentile (0..100) with linear interpolation (numpy's default); None when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median_or_none(values: Iterable[Optional[float]]) -> Optional[float]:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize_arm(rows: List[dict], wall_s: float) -> dict:
    """The figures of one arm from its per-request rows (see `_one_request`)."""
    ok = [r for r in rows if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    gaps = [g for r in ok for g in r["gaps"]]
    errors = [r["error"] for r in rows if r["error"] is not None]
    return {
        "requests": len(rows), "errors": len(errors), "error_samples": sorted(set(errors))[:3],
        "completion_tokens": tokens, "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else None,
        "req_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50_s": percentile((r["ttft"] for r in ok), 50), "ttft_p95_s": percentile((r["ttft"] for r in ok), 95),
        "itl_p50_s": percentile((r["itl"] for r in ok), 50), "itl_p95_s": percentile((r["itl"] for r in ok), 95),
        "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p95_s": percentile(gaps, 95),
        "e2e_p50_s": percentile((r["e2e"] for r in ok), 50), "e2e_p95_s": percentile((r["e2e"] for r in ok), 95),
    }


def lane_counters(snapshot: Optional[dict]) -> Optional[tuple]:
    """(sum lane_row_cycles, sum lane_cycles) over the snapshot's replicas; None when any replica
    lacks them (older servers) or the snapshot failed."""
    replicas = (snapshot or {}).get("replicas") or {}
    if not replicas:
        return None
    rows = cycles = 0
    for rep in replicas.values():
        if not isinstance(rep, dict) or "lane_row_cycles" not in rep or "lane_cycles" not in rep:
            return None
        rows += rep["lane_row_cycles"]
        cycles += rep["lane_cycles"]
    return rows, cycles


def lane_occupancy(before: Optional[dict], after: Optional[dict]) -> Optional[float]:
    """Mean live rows per decode cycle between two snapshots; None without counters or cycles."""
    a, b = lane_counters(before), lane_counters(after)
    if a is None or b is None or b[1] - a[1] <= 0:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def comparable_text(text: str) -> str:
    """The text without one leading space: mlx-lm's streaming detokenizer drops the first
    token's leading space (`trim_space`), ours keeps it; every other character counts."""
    return text[1:] if text.startswith(" ") else text


def greedy_rows(key: str, rows: List[dict]) -> Optional[List[dict]]:
    """The rows of arm `key` whose request was greedy: all of a greedy arm's, those at temperature
    0 of the mixed arm's (`mixed_settings`); None for a sampled arm."""
    label = key.split("/")[0]
    if label == _temp_label(0.0):
        return rows
    if label == MIXED:
        return [r for r in rows if mixed_settings(r["index"])[0] == 0]
    return None


def identical_by_arm(ours: Dict[str, List[dict]], peer: Dict[str, List[dict]]) -> Dict[str, dict]:
    """`identical_texts` of each arm with greedy requests, over those requests only."""
    out = {}
    for key, rows in ours.items():
        mine, theirs = greedy_rows(key, rows), greedy_rows(key, peer.get(key, []))
        if mine is not None:
            out[key] = identical_texts(mine, theirs)
    return out


def identical_texts(ours: List[dict], peer: List[dict]) -> dict:
    """How many requests (same index, both succeeded) produced the same completion text (see
    `comparable_text`), and the first indices that differ."""
    peer_by_index = {r["index"]: r for r in peer if r["error"] is None}
    pairs = [(r, peer_by_index[r["index"]]) for r in ours if r["error"] is None and r["index"] in peer_by_index]
    differ = [a["index"] for a, b in pairs if comparable_text(a["text"]) != comparable_text(b["text"])]
    same = len(pairs) - len(differ)
    return {"identical": same, "compared": len(pairs), "fraction": same / len(pairs) if pairs else None,
            "differing_indices": differ[:10]}


# ----------------------------------------------------------------------------------------------
# The peer's checkpoint


def strip_safetensors(src: Path, dst: Path, drop: Callable[[str], bool]) -> List[str]:
    """Copy a safetensors file without the tensors whose name `drop` accepts; returns the
    dropped names. Kept tensors are copied as raw bytes (any dtype, bf16 and quantized
    included), and the header's `__metadata__` is kept."""
    with open(src, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        meta = header.pop("__metadata__", None)
        kept = sorted((n for n in header if not drop(n)), key=lambda n: header[n]["data_offsets"][0])
        new_header, offset = {}, 0
        for name in kept:
            begin, end = header[name]["data_offsets"]
            new_header[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
        if meta is not None:
            new_header["__metadata__"] = meta
        blob = json.dumps(new_header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)      # the format pads the header to 8 bytes
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for name in kept:
                begin, end = header[name]["data_offsets"]
                f.seek(data_start + begin)
                out.write(f.read(end - begin))
    return sorted(n for n in header if drop(n))


def is_mtp_tensor(name: str) -> bool:
    return name.startswith("mtp.")


def make_peer_checkpoint(model_dir: Path, out_dir: Path) -> dict:
    """A copy of `model_dir` that `mlx_lm.server` loads: every `mtp.*` tensor removed from every
    safetensors file (and from a shard index), `mtp_num_hidden_layers` dropped from config.json.
    Every other file is copied as is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dropped: List[str] = []
    for path in sorted(model_dir.iterdir()):
        if path.is_dir():
            continue
        dst = out_dir / path.name
        if path.suffix == ".safetensors":
            dropped += strip_safetensors(path, dst, is_mtp_tensor)
        elif path.name == "config.json":
            cfg = json.loads(path.read_text())
            for c in (cfg, cfg.get("text_config") or {}):
                c.pop("mtp_num_hidden_layers", None)
            dst.write_text(json.dumps(cfg, indent=2))
        elif path.name.endswith(".safetensors.index.json"):
            index = json.loads(path.read_text())
            index["weight_map"] = {k: v for k, v in index.get("weight_map", {}).items() if not is_mtp_tensor(k)}
            dst.write_text(json.dumps(index, indent=2))
        else:
            shutil.copy2(path, dst)
    return {"path": str(out_dir), "dropped_tensors": len(dropped)}


# ----------------------------------------------------------------------------------------------
# Server processes


def _venv_bin(name: str) -> str:
    """A console script of the interpreter running the bench (the project's venv)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _kill_tagged(tag: str) -> List[int]:
    """SIGKILL every process whose environment carries MTPLX_BENCH_TAG=tag: only processes this
    bench started (and their descendants) have it, so another user's Ray is never touched (what
    `ray stop --force` would do). Linux only (/proc); returns the pids killed."""
    marker = f"MTPLX_BENCH_TAG={tag}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (OSError, ValueError):
            continue
    return killed


class ServerProcess:
    """A server started in its own process group, with a tag in its environment for cleanup."""

    def __init__(self, kind: str, cmd: List[str], env: dict, log_path: Path, url: str, model: str,
                 stop_signal: int, cleanup_dir: Optional[Path] = None):
        self.kind, self.cmd, self.url, self.model, self.log_path = kind, cmd, url, model, log_path
        self.stop_signal, self.cleanup_dir = stop_signal, cleanup_dir
        self.info: dict = {}
        self.tag = uuid.uuid4().hex
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "MTPLX_BENCH_TAG": self.tag},
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, path: str, timeout_s: float) -> dict:
        """Poll GET `path` until it answers 200; returns its JSON body. Fails early, with the log's
        tail, if the process exits."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + path, timeout=10)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.kind} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 60.0) -> dict:
        """Send the stop signal to the main process only (SIGINT makes `serve run` shut Serve and
        its local Ray down in order), SIGKILL the group after grace_s, then kill any tagged
        leftover (Ray daemons can outlive a killed driver)."""
        try:
            self.proc.send_signal(self.stop_signal)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        leftovers = _kill_tagged(self.tag)
        self._log.close()
        if self.cleanup_dir is not None:
            shutil.rmtree(self.cleanup_dir, ignore_errors=True)
        return {"returncode": self.proc.returncode, "leftovers_killed": len(leftovers)}


def start_ours(model_dir: Optional[Path], log_path: Path, work_dir: Path, ready_timeout_s: float,
               args_overrides: Optional[dict] = None, direct_http: bool = False) -> ServerProcess:
    """`serve run` of the shipped config with a free port (and `model_path` when given, and any
    app `args` overridden), on a fresh local Ray whose temp dir is private to this start. With
    `direct_http` the ingress replica also answers HTTP on a port of its own (`direct_http_env`),
    and the returned server's url is that port's."""
    import yaml

    cfg = yaml.safe_load((ROOT / "serve_configs" / "config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    for app in cfg["applications"]:
        if model_dir is not None:
            app["args"]["model_path"] = str(model_dir)
        app["args"].update(args_overrides or {})
    cfg_path = work_dir / f"serve_config_{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    ray_tmp = Path(tempfile.mkdtemp(prefix="mtplx-bl-", dir="/tmp"))   # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in DIRECT_HTTP_ENV}
    env.update({"RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0"})
    direct_port = free_port() if direct_http else None
    env.update(direct_http_env(direct_port))
    server = ServerProcess("ours", [_venv_bin("serve"), "run", "--address", "local", str(cfg_path)], env,
                           log_path, f"http://127.0.0.1:{direct_port or port}", model="",
                           stop_signal=signal.SIGINT, cleanup_dir=ray_tmp)
    try:
        health = server.wait_ready("/health", ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    server.model = health.get("model") or ""
    server.info = {"config": cfg["applications"][0]["args"], "command": server.cmd,
                   "replicas": {rid: {k: rep.get(k) for k in ("blas_threads", "niceness", "installed_widths")}
                                for rid, rep in (health.get("replicas") or {}).items() if isinstance(rep, dict)}}
    return server


def peer_command(peer_model: Path, port: int, concurrency: int) -> List[str]:
    return [_venv_bin("mlx_lm.server"), "--model", str(peer_model), "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(concurrency), "--prompt-concurrency", str(concurrency),
            "--log-level", "WARNING"]


def start_peer(peer_model: Path, concurrency: int, log_path: Path, ready_timeout_s: float) -> ServerProcess:
    """`mlx_lm.server` as DESIGN.md's peer paragraph says: OpenBLAS preloaded (Linux), batch
    caps set, the HF hub cache directory present (its /v1/models fails without it)."""
    from huggingface_hub import constants

    os.makedirs(constants.HF_HUB_CACHE, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if sys.platform.startswith("linux") and os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    port = free_port()
    server = ServerProcess("peer", peer_command(peer_model, port, concurrency), env, log_path,
                           f"http://127.0.0.1:{port}", model=str(peer_model), stop_signal=signal.SIGTERM)
    try:
        server.wait_ready("/health", ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    server.info = {"command": server.cmd, "ld_preload": env.get("LD_PRELOAD"), "concurrency": concurrency,
                   "seed_sent": False}
    return server


# ----------------------------------------------------------------------------------------------
# Load generation


async def _one_request(client, index: int, body: dict) -> dict:
    """Stream one completion; times are from just before the request is sent."""
    t0 = time.perf_counter()
    row = {"index": index, "error": None, "ttft": None, "itl": None, "e2e": None, "tokens": 0, "text": "",
           "gaps": []}
    times, pieces, usage_tokens = [], [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:160]
                row["error"] = f"HTTP {r.status_code}: {detail}"
                return row
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):
                    row["error"] = f"stream error: {str(obj['error'])[:160]}"
                    return row
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                text = (obj.get("choices") or [{}])[0].get("text")
                if text:
                    times.append(time.perf_counter())
                    pieces.append(text)
    except Exception as exc:   # a failed request is a data point, not the end of the arm
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(pieces)
    row.update(e2e=end - t0, tokens=tokens, text="".join(pieces),
               gaps=[b - a for a, b in zip(times, times[1:])])
    if times:
        row["ttft"] = times[0] - t0
        if tokens > 1:
            row["itl"] = (times[-1] - times[0]) / (tokens - 1)
    return row


def _client(base_url: str, connections: int):
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900, connect=30), limits=limits)


async def closed_loop(base_url: str, bodies: List[dict], clients: int,
                      at_drain: Optional[Callable] = None) -> tuple:
    """`clients` workers; each sends the next request index as soon as its previous one ends.
    `at_drain(client)` (async) runs once, when the first worker finds no request left: from then
    on the last requests run with fewer neighbours. Returns (rows in index order, wall seconds)."""
    pending = iter(range(len(bodies)))
    rows: List[dict] = []
    drained = []

    async def worker(client):
        for i in pending:
            rows.append(await _one_request(client, i, bodies[i]))
        if at_drain is not None and not drained:
            drained.append(True)
            await at_drain(client)

    async with _client(base_url, clients) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return sorted(rows, key=lambda r: r["index"]), wall


async def open_loop(base_url: str, bodies: List[dict], arrivals: List[float]) -> tuple:
    """Request i is sent at arrivals[i] seconds after the start, whatever is still in flight."""
    async with _client(base_url, len(bodies)) as client:
        t0 = time.perf_counter()

        async def send(i):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            return await _one_request(client, i, bodies[i])

        rows = await asyncio.gather(*(send(i) for i in range(len(bodies))))
        wall = time.perf_counter() - t0
    return list(rows), wall


def _snapshot(base_url: str) -> Optional[dict]:
    import httpx

    try:
        r = httpx.get(base_url + "/v1/mtplx/snapshot", timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _snapshot_with(client) -> Optional[dict]:
    import httpx

    try:
        r = await client.get("/v1/mtplx/snapshot", timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _temp_label(temperature: Arm) -> str:
    if temperature == MIXED:
        return MIXED
    return "greedy" if temperature == 0 else f"t{temperature:g}"


def _warm_up(server: ServerProcess, temperatures: List[Arm], clients: int, send_seed: bool) -> None:
    """Short requests, alone and as a wave of `clients`, at each temperature, short and long
    prompts: lanes, compiled graphs and connections are ready before anything is timed."""
    for t in temperatures:
        bodies = [{**request_body(i, t, server.model, send_seed), "max_tokens": 16}
                  for i in range(max(clients, LONG_EVERY))]
        asyncio.run(closed_loop(server.url, bodies[:LONG_EVERY], 1))
        asyncio.run(closed_loop(server.url, bodies, clients))


def run_turn(server: ServerProcess, plan: dict, run: int, open_rate: Dict[Arm, Optional[float]],
             send_seed: bool, log: Callable[[str], None]) -> dict:
    """Every arm of the plan against one running server. `open_rate[t]` is the open-loop rate at
    temperature t (or of the mixed arm); when None (the peer's turn) it is taken from this turn's
    closed loop at CAPACITY_CLIENTS clients. Returns {"arms": {key: summary}, "rows": {key: rows}, "rates": ...}."""
    arms, rows_by_arm, rates = {}, {}, {}
    _warm_up(server, plan["temperatures"], max(plan["clients"]), send_seed)
    for t in plan["temperatures"]:
        label = _temp_label(t)
        for n in plan["clients"]:
            key = f"{label}/closed-{n}"
            count = closed_loop_requests(n, plan["per_client"], plan["min_requests"])
            bodies = [request_body(i, t, server.model, send_seed) for i in range(count)]
            arms[key], rows_by_arm[key] = _timed_arm(server, lambda at_drain: closed_loop(server.url, bodies, n,
                                                                                          at_drain))
            log(f"  {server.kind:4s} {key:18s} {_brief(arms[key])}")
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
    return {"arms": arms, "rows": rows_by_arm, "rates": rates}


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
        label = _temp_label(t)
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


def summarize_logprobs(per_run: List[dict]) -> dict:
    """Per arm: median tok/s without and with logprobs, and the median of the per-run ratios."""
    runs = [r["ours_logprobs"] for r in per_run if r.get("ours_logprobs")]
    arms = {}
    for key in (runs[0]["off"] if runs else ()):
        ratios = [r["on"][key]["tok_s"] / r["off"][key]["tok_s"] for r in runs
                  if r["on"][key]["tok_s"] and r["off"][key]["tok_s"]]
        arms[key] = {"off": median_or_none(r["off"][key]["tok_s"] for r in runs),
                     "on": median_or_none(r["on"][key]["tok_s"] for r in runs),
                     "on_over_off": statistics.median(ratios) if ratios else None}
    return arms


def format_logprobs_table(arms: dict) -> str:
    lines = ["| arm | tok/s without | tok/s with logprobs | with/without |", "|---|---:|---:|---:|"]
    for key, e in arms.items():
        lines.append(f"| {key} | {_fmt(e['off'], digits=1)} | {_fmt(e['on'], digits=1)} "
                     f"| {_fmt(e['on_over_off'], digits=3)} |")
    return "\n".join(lines)


def summarize_modes(per_run: List[dict]) -> dict:
    """Per arm: each mode's median tok/s over runs and the medians of the per-run ratios auto/ar
    and auto/mtp; per temperature, the largest drop of auto's median tok/s from one client count
    to the next (1 - lowest next/previous ratio)."""
    runs = [r["ours_modes"] for r in per_run if r.get("ours_modes")]
    if not runs:
        return {}
    modes = list(runs[0])
    arms = {}
    for key in runs[0][modes[0]]:
        entry = {m: median_or_none(r[m][key]["tok_s"] for r in runs) for m in modes}
        for other in ("ar", "mtp"):
            if "auto" in modes and other in modes:
                ratios = [r["auto"][key]["tok_s"] / r[other][key]["tok_s"] for r in runs
                          if r["auto"][key]["tok_s"] and r[other][key]["tok_s"]]
                entry[f"auto_over_{other}"] = statistics.median(ratios) if ratios else None
        arms[key] = entry
    drops = {}
    if "auto" in modes:
        by_temp: Dict[str, list] = {}
        for key, entry in arms.items():
            label, arm = key.split("/")
            by_temp.setdefault(label, []).append((int(arm.split("-")[1]), entry["auto"]))
        for label, points in by_temp.items():
            points.sort()
            steps = [b / a for (_, a), (_, b) in zip(points, points[1:]) if a and b]
            drops[label] = max(0.0, 1 - min(steps)) if steps else None
    return {"arms": arms, "auto_largest_drop": drops}


def format_modes_table(modes: dict) -> str:
    lines = ["| arm | auto tok/s | mtp tok/s | ar tok/s | auto/ar | auto/mtp |", "|---|---:|---:|---:|---:|---:|"]
    for key, e in modes["arms"].items():
        lines.append(f"| {key} | {_fmt(e.get('auto'), digits=1)} | {_fmt(e.get('mtp'), digits=1)} "
                     f"| {_fmt(e.get('ar'), digits=1)} | {_fmt(e.get('auto_over_ar'), digits=3)} "
                     f"| {_fmt(e.get('auto_over_mtp'), digits=3)} |")
    drops = {k: v for k, v in modes["auto_largest_drop"].items() if v is not None}
    if not drops:       # one client count: nothing to compare
        return "\n".join(lines)
    text = ", ".join(f"{k} {_fmt(v, 100, 1)}%" for k, v in drops.items())
    return "\n".join(lines + ["", f"Largest drop of auto's tok/s from one client count to the next: {text}."])


def _timed_arm(server: ServerProcess, run: Callable) -> tuple:
    """One arm, `run(at_drain)`, with lane snapshots around it for our server, and for a closed
    loop one more when its first client runs out of requests: `steady_lane_occupancy` is the
    lanes' rows per cycle while every client still had requests, apart from the drain at the
    arm's end (its last requests finishing with fewer and fewer neighbours)."""
    ours = server.kind == "ours"
    before = _snapshot(server.url) if ours else None
    drained: dict = {}

    async def at_drain(client):
        drained["snapshot"] = await _snapshot_with(client)

    rows, wall = asyncio.run(run(at_drain if ours else None))
    summary = summarize_arm(rows, wall)
    if ours:
        summary["lane_occupancy"] = lane_occupancy(before, _snapshot(server.url))
        summary["steady_lane_occupancy"] = lane_occupancy(before, drained.get("snapshot"))
    return summary, rows


def _brief(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:.0f}"

    return (f"{s['tok_s'] or 0:7.1f} tok/s  TTFT p95 {ms(s['ttft_p95_s'])} ms  ITL p50 {ms(s['itl_p50_s'])} ms"
            f"  errors {s['errors']}")


# ----------------------------------------------------------------------------------------------
# The benchmark


def bench_load(model_dir: Optional[str] = None, runs: int = 3, clients: Iterable[int] = DEFAULT_CLIENTS,
               temperatures: Iterable[float] = DEFAULT_TEMPERATURES, per_client: int = 6, min_requests: int = 12,
               open_requests: int = 48, seed: int = 0, ready_timeout_s: float = 600.0,
               modes: Iterable[str] = (), logprobs: Optional[int] = None, direct_http: bool = False,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Run the comparison (see the module docstring); returns the JSON-able record."""
    started = time.time()
    clients = sorted(set(int(c) for c in clients))
    temperatures = list(temperatures)
    capacity_clients = min(clients, key=lambda c: (abs(c - CAPACITY_CLIENTS), c))
    model_path = Path(model_dir).resolve() if model_dir else None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "build" / "bench"
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    plan = {"clients": clients, "temperatures": temperatures, "per_client": per_client,
            "min_requests": min_requests, "open_requests": open_requests, "seed": seed,
            "capacity_clients": capacity_clients, "modes": list(modes), "logprobs": logprobs,
            "direct_http": direct_http}
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
            finally:
                result["peer_stop"] = peer.stop()
            record["peer"] = peer.info
            log(f"run {run + 1}/{runs}: ours (serve run)")
            ours = start_ours(model_path, out_dir / "logs" / f"load-{stamp}-ours-{run}.log", work, ready_timeout_s,
                              direct_http=direct_http)
            try:
                o = run_turn(ours, plan, run, p["rates"], send_seed=True, log=log)
                if plan["modes"]:
                    result["ours_modes"] = run_mode_arms(ours, plan, run, log)
                if plan["logprobs"] is not None:
                    result["ours_logprobs"] = run_logprob_arms(ours, plan, run, log)
            finally:
                result["ours_stop"] = ours.stop()
            record["ours"] = ours.info
            result.update(peer=p["arms"], ours=o["arms"], open_rate_req_s={_temp_label(t): r for t, r in p["rates"].items()},
                          identical=identical_by_arm(o["rows"], p["rows"]),
                          loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
            record["per_run"].append(result)
    record["summary"] = summarize_runs(record["per_run"])
    record["mixed"] = summarize_mixed(record["summary"])
    record["modes"] = summarize_modes(record["per_run"])
    record["logprobs"] = summarize_logprobs(record["per_run"])
    record["elapsed_s"] = time.time() - started
    record["artifacts"] = {"json": str(out_dir / f"load-{stamp}.json"),
                           "logs": str(out_dir / "logs" / f"load-{stamp}-*.log")}
    return record


def _median_ratio(per_run: List[dict], num: tuple, den: tuple) -> Optional[float]:
    """Median over runs of the per-run tok/s ratio r[side][key] / r[side'][key'] for num = (side,
    key) and den = (side', key'); runs missing either figure (or with a zero one) are left out."""
    ratios = []
    for r in per_run:
        a, b = (r.get(side, {}).get(key, {}).get("tok_s") for side, key in (num, den))
        if a and b:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def summarize_runs(per_run: List[dict]) -> dict:
    """Per arm: the median over runs of each figure of each server (requests and errors are
    summed, so one bad run shows), the median of the per-run tok/s ratios ours/peer, (arms with
    greedy requests: greedy, and the mixed arm's temperature-0 ones) identical texts summed over
    runs, and for the mixed arm's closed loops the medians of the per-run ratios mixed/shared:
    its tok/s over the SHARED_TEMPERATURE arm's at the same client count, ours
    (`mixed_over_shared`) and the peer's (`peer_mixed_over_shared`), None without that arm."""
    out = {}
    for key in per_run[0]["ours"]:
        entry = {}
        for side in ("ours", "peer"):
            figures = [r[side][key] for r in per_run]
            entry[side] = {f: median_or_none(s.get(f) for s in figures)
                           for f, v in figures[0].items() if isinstance(v, (int, float)) or v is None}
            entry[side].update(requests=sum(s["requests"] for s in figures), errors=sum(s["errors"] for s in figures))
            entry[side]["error_samples"] = sorted({e for s in figures for e in s["error_samples"]})[:3]
        ratios = [r["ours"][key]["tok_s"] / r["peer"][key]["tok_s"] for r in per_run
                  if r["ours"][key]["tok_s"] and r["peer"][key]["tok_s"]]
        entry["tok_s_ratio"] = statistics.median(ratios) if ratios else None
        label, _, arm = key.partition("/")
        if label == MIXED and arm.startswith("closed-"):
            shared = f"{_temp_label(SHARED_TEMPERATURE)}/{arm}"
            for side, name in (("ours", "mixed_over_shared"), ("peer", "peer_mixed_over_shared")):
                entry[name] = _median_ratio(per_run, (side, key), (side, shared))
        if all(key in r["identical"] for r in per_run):
            same = sum(r["identical"][key]["identical"] for r in per_run)
            compared = sum(r["identical"][key]["compared"] for r in per_run)
            entry["greedy_identical"] = {"identical": same, "compared": compared,
                                         "fraction": same / compared if compared else None}
        out[key] = entry
    return out


def summarize_mixed(summary: dict) -> Dict[str, dict]:
    """The mixed arm's closed loops, one entry per client count (`closed-N`), from the summary:
    each server's tok/s, ours/peer, ours' lane rows per cycle, mixed/shared (ours, and the peer's)
    and identical texts of its greedy requests. Empty when the run has no mixed arm."""
    out = {}
    for key, e in summary.items():
        label, _, arm = key.partition("/")
        if label != MIXED or not arm.startswith("closed-"):
            continue
        out[arm] = {"clients": int(arm.split("-")[1]), "ours_tok_s": e["ours"].get("tok_s"),
                    "peer_tok_s": e["peer"].get("tok_s"), "ours_over_peer": e.get("tok_s_ratio"),
                    "lane_occupancy": e["ours"].get("lane_occupancy"),
                    "steady_lane_occupancy": e["ours"].get("steady_lane_occupancy"),
                    "mixed_over_shared": e.get("mixed_over_shared"),
                    "peer_mixed_over_shared": e.get("peer_mixed_over_shared"),
                    "greedy_identical": e.get("greedy_identical")}
    return out


# ----------------------------------------------------------------------------------------------
# Reporting


def _fmt(v, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(record: dict) -> str:
    """The markdown table of the summary: one row per arm and server."""
    lines = ["| arm | server | tok/s | ours/peer | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
             "| E2E p95 s | errors | lane rows/cycle | greedy identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, entry in record["summary"].items():
        for side in ("ours", "peer"):
            s = entry[side]
            ratio = _fmt(entry["tok_s_ratio"], digits=2) if side == "ours" else ""
            same = entry.get("greedy_identical")
            same_txt = f"{same['identical']}/{same['compared']}" if same and side == "ours" else ""
            occ = _fmt(s.get("lane_occupancy"), digits=2) if side == "ours" else ""
            lines.append(f"| {key} | {side} | {_fmt(s['tok_s'], digits=1)} | {ratio} | {_fmt(s['ttft_p50_s'], 1000)} "
                         f"| {_fmt(s['ttft_p95_s'], 1000)} | {_fmt(s['itl_p50_s'], 1000, 1)} "
                         f"| {_fmt(s['itl_p95_s'], 1000, 1)} | {_fmt(s['e2e_p95_s'], digits=2)} "
                         f"| {_fmt(s['errors'])} | {occ} | {same_txt} |")
    return "\n".join(lines)


def format_mixed_table(mixed: Dict[str, dict]) -> str:
    """The mixed arm per client count (see `summarize_mixed`)."""
    lines = ["| clients | ours tok/s | peer tok/s | ours/peer | lane rows/cycle | steady rows/cycle "
             "| mixed/shared ours | mixed/shared peer | greedy identical (t0 requests) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in mixed.values():
        same = e.get("greedy_identical")
        same_txt = f"{same['identical']}/{same['compared']}" if same else ""
        lines.append(f"| {e['clients']} | {_fmt(e['ours_tok_s'], digits=1)} | {_fmt(e['peer_tok_s'], digits=1)} "
                     f"| {_fmt(e['ours_over_peer'], digits=2)} | {_fmt(e['lane_occupancy'], digits=2)} "
                     f"| {_fmt(e.get('steady_lane_occupancy'), digits=2)} "
                     f"| {_fmt(e['mixed_over_shared'], digits=3)} | {_fmt(e['peer_mixed_over_shared'], digits=3)} "
                     f"| {same_txt} |")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """Throughput and TTFT p95 against closed-loop clients, both servers, each temperature (and
    the mixed arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = record["plan"]["clients"]
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for t in record["plan"]["temperatures"]:
        label = _temp_label(t)
        for side, color in (("ours", "tab:blue"), ("peer", "tab:orange")):
            name = "mtplx (ours)" if side == "ours" else "mlx_lm.server"
            style = ":^" if t == MIXED else "-o" if t == 0 else "--s"
            figs = [record["summary"][f"{label}/closed-{n}"][side] for n in clients]
            ax_tput.plot(clients, [f["tok_s"] for f in figs], style, color=color, label=f"{name}, {label}")
            ax_ttft.plot(clients, [None if f["ttft_p95_s"] is None else 1000 * f["ttft_p95_s"] for f in figs],
                         style, color=color, label=f"{name}, {label}")
    for ax, title, ylabel in ((ax_tput, "completion throughput", "tok/s"),
                              (ax_ttft, "time to first token, p95", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels([str(c) for c in clients])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench load: median of {record['runs']} run(s), {record['machine']['cpu_count']} CPUs, "
                 f"{record['date'][:10]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_section(record: dict, table: str, image: str, command: str, name: str = "load") -> str:
    """The `bench:load` section of BENCHMARKS.md."""
    m, rt, peer = record["machine"], record["machine"]["runtime"], record.get("peer", {})
    n = peer.get("concurrency")
    rates = ", ".join(f"{k} {v:.2f}" for k, v in (record["per_run"][-1].get("open_rate_req_s") or {}).items())
    counts = ", ".join(f"{k}: {v}" for k, v in record["requests_per_arm"].items())
    quick = " (quick smoke run: few requests, not representative)" if record.get("quick") else ""
    variant = name[len("load-"):]
    lines = [
        f"## bench load{f' ({variant})' if variant else ''}: mtplx vs mlx_lm.server{quick}",
        "",
        f"`{command}`, {record['date']}, {record['runs']} run(s), {record['elapsed_s'] / 60:.1f} min.",
        f"Machine: `{m['platform']}`, {m['cpu_count']} CPUs, BLAS {rt.get('blas')} (`{rt.get('blas_path')}`),",
        f"mlx {rt.get('mlx_version')} on `{rt.get('mlx_device')}`, mlx-lm {rt.get('mlx_lm_version')}, "
        f"Python {rt.get('python')}. Model: {record['model']}.",
        "",
        "Ours: `serve run serve_configs/config.yaml` on a free port" + (
            ", clients on the ingress replica's own port (`--direct-http`: Serve's direct ingress, no proxy hop)"
            if record["plan"].get("direct_http") else "") + ". Peer: `mlx_lm.server "
        f"--decode-concurrency {n} --prompt-concurrency {n}` on the same checkpoint without its `mtp.*`",
        f"tensors, with `LD_PRELOAD={peer.get('ld_preload')}`. One server at a time; runs alternate peer, ours.",
        "",
        "Streaming `/v1/completions`; Python-code prompts, every 5th about 6x longer; `max_tokens` 16-256,",
        f"fixed per request index. Closed loops at {', '.join(map(str, record['plan']['clients']))} clients; "
        f"requests per arm: {counts}.",
        f"Open loop: Poisson arrivals at {record['open_loop']['load_fraction']:.0%} of the peer's closed-loop "
        f"request rate at {record['open_loop']['capacity_clients']} clients (last run: {rates} req/s).",
        "Sampled arms send `top_p` 0.95 and `top_k` 20 to both servers and a per-request `seed` to ours only",
        "(mlx_lm.server serves a seeded request outside its batch).",
        *(_mixed_lines() if MIXED in record["plan"]["temperatures"] else ()),
        "",
        "Figures are medians over runs (errors summed); ours/peer is the median of the per-run tok/s ratios.",
        "ITL: per request, (last chunk - first chunk) / (completion tokens - 1). Lane rows/cycle: mean live",
        "rows per decode cycle of our lanes during the arm (- when the server does not report it). Greedy",
        "identical: same completion text on both servers for the same request index, summed over runs",
        "(one leading space ignored: mlx-lm's streaming detokenizer drops it); in the mixed arm over its",
        "temperature-0 requests only.",
        "",
        table,
        "",
        f"![bench load]({image})",
    ]
    return "\n".join(lines) + "\n"


def _mixed_lines() -> List[str]:
    temps = ", ".join(f"{t:g}" for t in MIXED_TEMPERATURES)
    top_ps = ", ".join(f"{t:g}" for t in MIXED_TOP_PS)
    return [
        f"Mixed arm: each request sends one of the pairs of a temperature ({temps}) and a top_p ({top_ps}),",
        "each pair once in every block of 15 requests,",
        f"`top_k` {SAMPLED['top_k']}, to both servers; its sampled requests carry a `seed` to ours only.",
        f"Mixed/shared: the median of the per-run ratios of the mixed arm's tok/s over the "
        f"{_temp_label(SHARED_TEMPERATURE)} arm's at the same client count. Steady rows/cycle: the lanes' rows",
        "per cycle from the arm's start until its first client ran out of requests (the drain after it, the",
        "last requests finishing with fewer neighbours, left out).",
    ]


def section_name(record: dict) -> str:
    """`load` for the comparison as planned by default; a run with other arms or another model
    (`load-modes`, `load-logprobs`, `load-<model dir>`, ...) gets a section and chart of its own, so
    that it does not replace the default comparison. Temperatures other than the default arms'
    (0, 0.6 and `mixed`) add their labels (`load-modes-t1`), and so does a comparison with only
    some of the default arms (`load-greedy`, `load-greedy-t06`, `load-t06-mixed`); other client
    counts add them (`load-modes-c1`, `load-greedy-c16`)."""
    plan, parts = record["plan"], []
    if record["model"] != "shipped":
        parts.append(re.sub(r"[^a-z0-9]+", "-", Path(record["model"]).name.lower()).strip("-") or "model")
    if plan.get("direct_http"):
        parts.append("direct")
    if plan.get("modes"):
        parts.append("modes")
    if plan.get("logprobs") is not None:
        parts.append("logprobs")
    temperatures = plan.get("temperatures", ())
    extra_arms = plan.get("modes") or plan.get("logprobs") is not None
    partial = not extra_arms and temperatures and set(temperatures) < set(DEFAULT_TEMPERATURES)
    parts += [_temp_label(t).replace(".", "") for t in temperatures if partial or t not in DEFAULT_TEMPERATURES]
    if plan.get("clients") and tuple(plan["clients"]) != DEFAULT_CLIENTS:
        parts.append("c" + "-".join(str(c) for c in plan["clients"]))
    return "-".join(["load", *parts])


def write_outputs(record: dict, command: str) -> dict:
    """JSON under build/bench/, the chart under docs/, the section of BENCHMARKS.md (`bench:load`
    for the default comparison, see `section_name`)."""
    name = section_name(record)
    png = ROOT / "docs" / f"bench_{name.replace('-', '_')}.png"
    plot(record, png)
    table = format_table(record)
    if record.get("modes"):
        table += "\n\nGeneration modes (ours; `--modes`):\n\n" + format_modes_table(record["modes"])
    if record.get("mixed"):
        table += ("\n\nMixed settings (per-request temperature and top_p; mixed/shared: over ours' "
                  f"{_temp_label(SHARED_TEMPERATURE)} arm):\n\n" + format_mixed_table(record["mixed"]))
    if record.get("logprobs"):
        table += (f"\n\nLogprobs (ours; `--logprobs {record['plan']['logprobs']}`):\n\n"
                  + format_logprobs_table(record["logprobs"]))
    md = ROOT / "BENCHMARKS.md"
    md.write_text(replace_section(md.read_text() if md.exists() else "", name,
                                  render_section(record, table, png.relative_to(ROOT).as_posix(), command, name)))
    record["artifacts"].update(png=str(png), markdown=str(md))
    Path(record["artifacts"]["json"]).write_text(json.dumps(record, indent=2, default=str))
    return {"table": table, **record["artifacts"]}


def run_cli(quick: bool = False, runs: int = 3, clients: Optional[str] = None, model: Optional[str] = None,
            json_out: bool = False, per_client: Optional[int] = None, open_requests: Optional[int] = None,
            modes: Optional[str] = None, logprobs: Optional[int] = None,
            temperatures: Optional[str] = None, direct_http: bool = False) -> dict:
    """The `mtplx bench load` entry: `--quick` is 1 run, clients {1, 8}, greedy, few requests."""
    if quick:
        opts = dict(runs=1, clients=(1, 8), temperatures=(0.0,), per_client=2, min_requests=4, open_requests=16)
    else:
        opts = dict(runs=runs, clients=DEFAULT_CLIENTS, temperatures=DEFAULT_TEMPERATURES, per_client=6, min_requests=12,
                    open_requests=48)
    if clients:
        opts["clients"] = [int(c) for c in clients.split(",")]
    if per_client:
        opts["per_client"] = per_client
    if open_requests:
        opts["open_requests"] = open_requests
    if temperatures:
        opts["temperatures"] = parse_temperatures(temperatures)
    if modes:
        opts["modes"] = [m.strip() for m in modes.split(",")]
    if logprobs is not None:
        opts["logprobs"] = logprobs
    record = bench_load(model_dir=model, direct_http=direct_http, **opts)
    record["quick"] = quick
    command = "mtplx bench load" + (" --quick" if quick else f" --runs {opts['runs']}") + \
        (f" --clients {clients}" if clients else "") + (f" --temperatures {temperatures}" if temperatures else "") + \
        (f" --model {model}" if model else "") + \
        (f" --requests-per-client {per_client}" if per_client else "") + \
        (f" --open-requests {open_requests}" if open_requests else "") + \
        (f" --modes {modes}" if modes else "") + (f" --logprobs {logprobs}" if logprobs is not None else "") + \
        (" --direct-http" if direct_http else "")
    out = write_outputs(record, command)
    if json_out:
        print(json.dumps(record, default=str), flush=True)
    else:
        print(out["table"])
        print(f"\nJSON: {out['json']}\nchart: {out['png']}\nsection: {out['markdown']}", flush=True)
    return record


def main(argv=None) -> int:
    import argparse

    from mtplx.cli import add_load_options

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 run, clients 1,8, greedy only, few requests")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", default=None, help="comma-separated closed-loop client counts (default 1,8,16,32)")
    p.add_argument("--model", default=None, help="checkpoint dir for both servers (default: the shipped model)")
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the table")
    p.add_argument("--direct-http", action="store_true", help="ours: clients call the ingress replica on its own port")
    add_load_options(p)
    a = p.parse_args(argv)
    if a.temperatures:
        try:
            parse_temperatures(a.temperatures)
        except ValueError as exc:
            p.error(str(exc))
    run_cli(quick=a.quick, runs=a.runs, clients=a.clients, model=a.model, json_out=a.json,
            per_client=a.requests_per_client, open_requests=a.open_requests, modes=a.modes,
            logprobs=a.logprobs, temperatures=a.temperatures, direct_http=a.direct_http)
    return 0


if __name__ == "__main__":
    sys.exit(main())
