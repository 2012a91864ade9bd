"""The process-wide settings a test could change and leave to the tests after it: environment,
working directory, BLAS threads, CPU affinity, niceness, the garbage collector, MLX's default
device and stream, signal handlers, logging, interpreter limits and hooks, and whether Ray is
initialized here. `tests/conftest.py` compares them around every test; fixtures that build
something which sets them (an in-process model replica or ingress) restore them with `restored()`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading

SIGNALS = [s for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD",
                       "SIGPIPE") if hasattr(signal, s)]


def _root_handlers() -> tuple:
    # pytest's own capture handlers come and go with each phase of a test
    return tuple(h for h in logging.root.handlers if not type(h).__module__.startswith("_pytest"))


def snapshot() -> dict:
    import mlx.core as mx

    from mtplx.runtime import set_blas_threads

    return {
        "environment": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},   # pytest's own
        "cwd": os.getcwd(),
        "blas_threads": set_blas_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "niceness": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
        # (a frozen heap's count falls as its objects are freed: whether one is frozen is the setting)
        "gc": (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count() > 0),
        "mlx_default_device": str(mx.default_device()),
        "mlx_default_stream": str(mx.default_stream(mx.default_device())),
        "signal_handlers": {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS},
        "logging": (logging.root.level, _root_handlers(), logging.root.manager.disable),
        "interpreter": (sys.getrecursionlimit(), sys.getswitchinterval(), sys.excepthook, threading.excepthook),
        "ray_initialized": "ray" in sys.modules and sys.modules["ray"].is_initialized(),
    }


def changes(before: dict, after: dict) -> dict:
    """{setting: (before, after)} for each setting that differs (the environment by variable)."""
    out = {}
    for key, old in before.items():
        new = after[key]
        if key == "environment":
            for var in sorted(set(old) | set(new)):
                if old.get(var) != new.get(var):
                    out[f"environment {var}"] = (old.get(var), new.get(var))
        elif old != new:
            out[key] = (old, new)
    return out


def restore(before: dict) -> None:
    """Put back every setting of `before` that can be put back (a Ray started here is not stopped:
    the caller knows whether it should be)."""
    import mlx.core as mx

    from deployments._proc import renice_process
    from mtplx.runtime import set_blas_threads

    for var in set(os.environ) - set(before["environment"]) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[var]
    os.environ.update(before["environment"])
    os.chdir(before["cwd"])
    if before["blas_threads"] is not None:
        set_blas_threads(before["blas_threads"])
    if before["cpu_affinity"] is not None and sorted(os.sched_getaffinity(0)) != before["cpu_affinity"]:
        os.sched_setaffinity(0, before["cpu_affinity"])
    if before["niceness"] is not None and os.getpriority(os.PRIO_PROCESS, 0) != before["niceness"]:
        renice_process(before["niceness"])
    enabled, threshold, frozen = before["gc"]
    (gc.enable if enabled else gc.disable)()
    gc.set_threshold(*threshold)
    if not frozen and gc.get_freeze_count() > 0:      # a serving process's startup freeze
        gc.unfreeze()
    for name, handler in before["signal_handlers"].items():
        if signal.getsignal(getattr(signal, name)) is not handler and handler is not None:
            signal.signal(getattr(signal, name), handler)
    level, handlers, disabled = before["logging"]
    logging.root.setLevel(level)
    for h in set(_root_handlers()) - set(handlers):
        logging.root.removeHandler(h)
    for h in handlers:
        if h not in logging.root.handlers:
            logging.root.addHandler(h)
    logging.disable(disabled)
    recursion, switch, excepthook, thread_excepthook = before["interpreter"]
    sys.setrecursionlimit(recursion)
    sys.setswitchinterval(switch)
    sys.excepthook, threading.excepthook = excepthook, thread_excepthook
    if str(mx.default_device()) != before["mlx_default_device"]:
        mx.set_default_device(mx.gpu if "gpu" in before["mlx_default_device"] else mx.cpu)


@contextlib.contextmanager
def restored():
    """Whatever runs inside leaves the process's settings as it found them."""
    before = snapshot()
    try:
        yield
    finally:
        restore(before)
