"""Ray on loopback: `serve run serve_configs/config.yaml` as scripts/serve.sh starts it, and this
session's own Ray, listen on 127.0.0.1 only; every listening socket of their processes is
checked. The one exception is Ray Serve's own: each Serve replica opens a gRPC port for calls
between deployments on every interface (hard-coded in Ray Serve 2.60); it must refuse a call
that does not carry Ray's token."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments._proc import LOOPBACK_RAY_ENV, is_loopback

REPO = Path(__file__).resolve().parents[1]
SERVE_REPLICA = "ray::ServeReplica"


def _listeners(procs) -> list:
    """(command line, address, port) of every listening TCP socket of `procs`."""
    import psutil

    out = []
    for p in procs:
        try:
            command = " ".join(p.cmdline()) or p.name()
            out += [(command, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:      # a worker that ended while we looked
            continue
    return out


def _tagged(p, tag: str) -> bool:
    """Whether `p` is of a server `benchmarks.servers` started (its descendants carry its tag)."""
    import psutil

    try:
        return p.environ().get("MTPLX_BENCH_TAG") == tag
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _answer_without_token(port: int) -> str:
    """What a Serve replica's gRPC port answers a call that carries no token."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=120)
        except grpc.RpcError as err:
            return err.code().name
    return "an answer"


def _check_loopback_only(listeners: list) -> None:
    assert listeners, "no listening socket found"
    open_to_all = [(cmd, ip, port) for cmd, ip, port in listeners if not is_loopback(ip)]
    not_serve = [entry for entry in open_to_all if not entry[0].startswith(SERVE_REPLICA)]
    assert not not_serve, f"listening beyond loopback: {not_serve} (all: {sorted(listeners)})"
    per_replica = {}
    for cmd, _ip, port in open_to_all:
        per_replica.setdefault(cmd, []).append(port)
    for cmd, ports in per_replica.items():
        assert len(ports) == 1, (cmd, ports)
        assert _answer_without_token(ports[0]) == "UNAUTHENTICATED", (cmd.strip(), ports[0])


@pytest.mark.slow
def test_serve_run_as_serve_sh_starts_it_listens_on_loopback_only(tmp_path):
    """`serve run` of the shipped config in scripts/serve.sh's environment: a fresh local Ray (GCS,
    raylet, object manager, dashboard, agents, workers) and Serve's proxy on 127.0.0.1 only."""
    import httpx
    import psutil

    from benchmarks.servers import start_ours

    serve_sh = (REPO / "scripts" / "serve.sh").read_text()
    for var, value in LOOPBACK_RAY_ENV.items():
        assert f'export {var}="${{{var}:-{value}}}"' in serve_sh, f"scripts/serve.sh does not export {var}"
    server = start_ours(None, tmp_path / "serve.log", tmp_path, ready_timeout_s=300)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "mtplx-tiny-py", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        listeners = _listeners([p for p in psutil.process_iter() if _tagged(p, server.tag)])
        for part in ("gcs_server", "raylet", "dashboard.py", "ray::ProxyActor", SERVE_REPLICA):
            assert any(part in cmd for cmd, _, _ in listeners), f"no {part} among {sorted(listeners)}"
        _check_loopback_only(listeners)
    finally:
        server.stop()
    assert "reachable from the network" not in server.log_path.read_text(errors="replace")


@pytest.mark.ray
def test_the_sessions_ray_listens_on_loopback_only(serve_app):
    import psutil
    import ray

    assert is_loopback(ray.util.get_node_ip_address())
    assert is_loopback(ray.get_runtime_context().gcs_address.rsplit(":", 1)[0])
    _check_loopback_only(_listeners(psutil.Process().children(recursive=True)))
