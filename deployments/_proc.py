"""Process helpers shared by the deployments (stdlib only)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Optional

log = logging.getLogger("ray.serve")


def free_port() -> int:
    """A free TCP port on the loopback interface (for a local Serve HTTP proxy)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    tids = []
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    failed = None
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, int(niceness))
        except OSError as exc:
            failed = exc
    if failed is not None:
        log.warning("mtplx: could not set niceness %s (%s); keeping %s", niceness, failed,
                    os.getpriority(os.PRIO_PROCESS, 0))
    return os.getpriority(os.PRIO_PROCESS, 0)
