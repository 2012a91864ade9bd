"""Process helpers shared by the deployments (stdlib only)."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Optional

log = logging.getLogger("ray.serve")


# Ray on this machine only. On Linux Ray takes a node's address from the route to the outside (it
# turns an explicit 127.0.0.1 into that address too), and its GCS, raylet, object manager, agents
# and workers listen there; with this variable at 0 (macOS's and Windows's default) every node
# address is 127.0.0.1. Ray reads it when `ray` is imported: it belongs in the environment of the
# process that starts Ray (scripts/serve.sh exports it). A cluster of several machines is started
# without it (README: several machines).
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def is_loopback(host: str) -> bool:
    """Whether `host` (an address as sockets and Ray report it) is this machine's loopback."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    mapped = getattr(addr, "ipv4_mapped", None)     # ::ffff:127.0.0.1, a dual-stack socket's view
    return (mapped or addr).is_loopback


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local Serve HTTP proxy)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ray Serve's direct ingress: the ingress replica answers HTTP on its own port, next to Serve's
# proxy (which keeps the configured port). Read by Ray's processes at start, so it is set in the
# environment of whatever starts Ray (`serve run --address local`, `ray start`).
DIRECT_HTTP_ENV = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
                   "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
                   "RAY_SERVE_PORT_QUARANTINE_S")


def direct_http_enabled() -> bool:
    """Whether the Ray this process belongs to was started with direct HTTP (`direct_http_env`)."""
    return os.environ.get(DIRECT_HTTP_ENV[0]) == "1"


def direct_http_env(port: Optional[int], ports: int = 1) -> dict:
    """The environment for Ray that makes the ingress replica serve HTTP itself on `port` (None:
    only through Serve's proxy). Every request then skips the proxy process and a Ray hop each way
    (README, direct HTTP: what it measured under overload). Ingress
    replicas (of every application) take ports from `port` up, one each: `ports` of them fit on a
    node; the first one deployed gets `port`. Tuned for ports with no load balancer in front: the
    drain before an ingress replica stops (30 s by default, for balancers to notice) is 1 s, and a
    port freed by a replica that stopped is not held back from its successor (by default it is,
    for a balancer's stale entries to expire)."""
    if port is None:
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    # (Ray's range excludes its upper end)
    return dict(zip(DIRECT_HTTP_ENV, ("1", str(port), str(port + ports), "1", "0")))


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now into the collector's permanent generation.
    A serving process builds its long-lived objects at start (Ray and Serve internals, the
    tokenizer, the model's Python side); full collections, which stall the event loop, then scan
    only what serving allocates."""
    gc.collect()
    gc.freeze()


def renice_process(niceness: Optional[int]) -> Optional[int]:
    """Set every thread of this process to `niceness` (None: leave it). Returns the niceness now
    in effect for the calling thread.

    Ray starts worker processes (Serve replicas included) at niceness 15 so that its control plane
    stays responsive. On a machine that also runs other compute, a model replica at 15 loses most
    of the CPU to them; the app builder asks for 0 by default. Lowering niceness needs privilege
    (CAP_SYS_NICE); without it this logs once and keeps Ray's value. On Linux niceness is per
    thread, so every thread under /proc/self/task is set (threads created later inherit it from
    their creator).
    """
    if niceness is None or not hasattr(os, "setpriority"):
        return None
    tids = _tids("self") or [0]
    failed = _set_threads_niceness(tids, niceness)
    if failed is not None:
        log.warning("mtplx: could not set niceness %s (%s); keeping %s", niceness, failed,
                    os.getpriority(os.PRIO_PROCESS, 0))
    return os.getpriority(os.PRIO_PROCESS, 0)


def _set_threads_niceness(tids, niceness: int) -> Optional[OSError]:
    """These threads to `niceness`; the last error, if any."""
    failed = None
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, int(niceness))
        except OSError as exc:
            failed = exc
    return failed


# Serve's HTTP proxy, as Ray names its worker process
PROXY_PROCESS = b"ray::ProxyActor"
_PROXY_WARNED: set = set()
_PROXY_PIDS: list = []        # the proxies the last scan found


def renice_serve_proxy(niceness: Optional[int]) -> dict:
    """Serve's HTTP proxies on this node (Linux): every thread that runs weaker than `niceness` is
    set to it. Returns {pid: the weakest niceness among its threads now}.

    Ray starts its workers at niceness 15, Serve's proxy included, while the model replica runs at
    0 (`renice_process`). With the CPU busy, a proxy at 15 gets about a thirtieth of the replica's
    share, and every request, refusal and streamed chunk waits on it (README: what it measured).
    /health calls this: the proxies found are looked at again directly, and /proc is scanned
    again only when one of them has gone (a restarted proxy starts at 15 again)."""
    if niceness is None or not hasattr(os, "setpriority") or not os.path.isdir("/proc"):
        return {}
    known = _PROXY_PIDS and all(_is_proxy(pid) for pid in _PROXY_PIDS)
    pids = list(_PROXY_PIDS) if known else [int(e) for e in os.listdir("/proc") if e.isdigit() and _is_proxy(int(e))]
    found = {}
    for pid in pids:
        weakest = _renice_proxy(pid, niceness)
        if weakest is not None:
            found[pid] = weakest
    _PROXY_PIDS[:] = sorted(found)
    return found


def _renice_proxy(pid: int, niceness: int) -> Optional[int]:
    """Set a proxy's weaker threads to `niceness`; its weakest niceness now (None: it is gone)."""
    try:
        tids = _tids(pid)
        if not tids:
            return None
        failed = _set_threads_niceness([t for t in tids if os.getpriority(os.PRIO_PROCESS, t) > niceness], niceness)
        if failed is not None and pid not in _PROXY_WARNED:     # once per proxy
            _PROXY_WARNED.add(pid)
            log.warning("mtplx: could not set the Serve proxy's niceness to %s (%s)", niceness, failed)
        return max(os.getpriority(os.PRIO_PROCESS, t) for t in tids)
    except OSError:      # the process or a thread ended while we looked
        return None


def _is_proxy(pid: int) -> bool:
    return _cmdline(pid).startswith(PROXY_PROCESS)


# A model replica, as Ray names its worker process (ray::ServeReplica:<app>:MTPReplica)
MODEL_REPLICA_PROCESS = b"MTPReplica"
KEEP_OFF_EVERY_S = 10.0       # how often the replica moves its node's Ray workers off its CPUs again


def pin_replica_cpus(count: Optional[int]) -> Optional[tuple]:
    """Every thread of this Ray worker onto the first `count` CPUs of its node (Linux; threads
    created later inherit it), the rest left to the node's other Ray workers (`keep_node_off`).
    The node's CPUs are its raylet's (this process's parent, never moved): a worker that the
    keep-off moved before it became a replica still finds them all. Returns (its CPUs, the rest),
    or None where `count` is None or the platform cannot pin (logged).

    Why: on a small node the model's compute shares its cores with Serve's proxy, the ingress and
    Ray's agents, and every wake-up of theirs on the model's core stalls a cycle (README: what it
    measured). A count, not CPU ids: the same config serves nodes with other CPU sets."""
    if count is None:
        return None
    if count < 1:
        raise ValueError(f"replica_cpus={count!r}: a replica needs at least 1 CPU (null: no pinning)")
    if not hasattr(os, "sched_setaffinity"):
        log.warning("mtplx: replica_cpus=%s ignored: this platform cannot pin threads to CPUs", count)
        return None
    try:
        node = sorted(os.sched_getaffinity(os.getppid()))
    except OSError:
        node = sorted(os.sched_getaffinity(0))
    mine, rest = node[:count], node[count:]
    if not rest:
        log.warning("mtplx: replica_cpus=%s takes all %s CPUs of this node: nothing left to move the "
                    "node's other Ray workers to", count, len(node))
    if not _pin_threads("self", mine):
        os.sched_setaffinity(0, mine)          # no /proc to list threads: this one, which the rest inherit from
    return mine, rest


def keep_node_off(cpus: list, every_s: float = KEEP_OFF_EVERY_S) -> threading.Thread:
    """A daemon thread on `cpus` that moves, now and every `every_s`, the Ray workers under this
    worker's raylet (Serve's proxy and controller, the ingress, Ray's agents; model replicas
    excepted) onto `cpus`, so that those started later (a restarted proxy) follow. The raylet
    itself stays where it is, so the workers it starts (a replica restarting) start on every CPU.
    It stops when the raylet is gone (this worker is re-parented)."""
    raylet, mine = os.getppid(), sorted(os.sched_getaffinity(0))

    def loop():
        os.sched_setaffinity(0, cpus)          # this thread: off the model's CPUs too
        me = threading.get_native_id()
        while os.getppid() == raylet:
            try:
                _pin_threads("self", mine, skip=me)    # threads this worker started meanwhile
                move_node_processes(raylet, cpus)
            except Exception:                # keep going: a scan that fails moves nothing
                log.exception("mtplx: moving the node's Ray workers off the replica's CPUs failed")
            time.sleep(every_s)

    thread = threading.Thread(target=loop, daemon=True, name="mtplx-keep-node-off")
    thread.start()
    return thread


def move_node_processes(raylet: int, cpus: list) -> list:
    """The processes under `raylet`, except this one and model replicas, onto `cpus`. Returns the
    pids moved (a process that ended or is not ours is skipped)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    moved, stack, me = [], list(children.get(raylet, [])), os.getpid()
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if pid == me or MODEL_REPLICA_PROCESS in _cmdline(pid).split(b"\0")[0]:    # its process title
            continue
        if _pin_threads(pid, cpus):
            moved.append(pid)
    return moved


def _pin_threads(pid, cpus: list, skip: Optional[int] = None) -> bool:
    """Every thread of process `pid` ("self": this one), but `skip`, onto `cpus`. False when the
    process is gone or not ours."""
    tids = [t for t in _tids(pid) if t != skip]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue            # the thread ended while we looked
        except OSError:
            return False
    return bool(tids)


def _tids(pid) -> list:
    """The thread ids of process `pid` ("self": this one); [] when it is gone."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _parent(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
