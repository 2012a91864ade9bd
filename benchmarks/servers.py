"""The two servers of the served benches, each as its own process tree: ours (`serve run` of
`serve_configs/config.yaml`) and the peer (`mlx_lm.server` on a copy of the checkpoint without its
`mtp.*` tensors); starting, readiness, stopping with every leftover process, and the snapshot of
our lanes' counters."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, List, Optional, Union

from benchmarks.report import ROOT
from mtplx.models.registry import check_installed
from deployments._proc import DIRECT_HTTP_ENV, LOOPBACK_RAY_ENV, direct_http_env, free_port

SHIPPED_MODEL = ROOT / "mtplx" / "assets" / "mtplx-tiny-py"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


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
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + path, timeout=10)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            except ValueError:      # a 200 that is not JSON: not our server's answer (yet)
                last = f" (last answer: {r.text[:200]!r})"
            time.sleep(1.0)
        raise TimeoutError(f"{self.kind} not ready after {timeout_s:.0f} s{last}:\n{self.log_tail()}")

    def peak_memory_mb(self) -> Optional[dict]:
        """The peak resident memory (VmHWM) of this server's processes, read before it stops: its
        largest process (the one holding the model) and the sum over all of them (Ray's daemons
        included). Linux only; None elsewhere."""
        marker = f"MTPLX_BENCH_TAG={self.tag}".encode()
        peaks = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                status = (entry / "status").read_text()
            except OSError:
                continue
            peaks += [int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
        return {"largest_process": max(peaks), "all_processes": sum(peaks), "processes": len(peaks)} if peaks else None

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


def start_ours(model_dir: Optional[Union[Path, str]], log_path: Path, work_dir: Path, ready_timeout_s: float,
               args_overrides: Optional[dict] = None, direct_http: bool = False,
               config: Optional[Path] = None) -> ServerProcess:
    """`serve run` of the shipped config (or `config`) with a free port (and `model_path` when
    given: a directory or an installed model's name, and any app `args` overridden), on a fresh local Ray whose temp dir is private to this start, on
    loopback as scripts/serve.sh starts it (`LOOPBACK_RAY_ENV`). With
    `direct_http` the ingress replica also answers HTTP on a port of its own (`direct_http_env`),
    and the returned server's url is that port's."""
    import yaml

    cfg = yaml.safe_load((config or ROOT / "serve_configs" / "config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    for app in cfg["applications"]:
        if model_dir is not None:
            app["args"]["model_path"] = str(Path(check_installed(str(model_dir))).resolve())
        app["args"].update(args_overrides or {})
    cfg_path = work_dir / f"serve_config_{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    ray_tmp = Path(tempfile.mkdtemp(prefix="mtplx-bl-", dir="/tmp"))   # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in DIRECT_HTTP_ENV}
    env.update({"RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0", **LOOPBACK_RAY_ENV})
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


def snapshot(base_url: str) -> Optional[dict]:
    import httpx

    try:
        r = httpx.get(base_url + "/v1/mtplx/snapshot", timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def snapshot_with(client) -> Optional[dict]:
    import httpx

    try:
        r = await client.get("/v1/mtplx/snapshot", timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
