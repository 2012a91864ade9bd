"""Process-level runtime setup: an optimized BLAS for MLX's CPU backend, and what is live.

The `mlx[cpu]` wheel links the reference netlib BLAS, ~30x slower than OpenBLAS, which makes a
[B, T] forward cost B*T times a [1, 1] forward and erases every batching and verify gain. Loading
an optimized BLAS into the global symbol scope *before* `mlx.core` is first imported makes MLX's
`cblas_*` calls resolve to it. This module must therefore be imported before anything imports MLX;
`mtplx/__init__.py` does that.

Environment:
  MTPLX_BLAS=off            keep whatever BLAS MLX links (the reference one on Linux)
  MTPLX_BLAS=/path/lib.so   load this library instead of searching the usual places
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from typing import Optional

log = logging.getLogger("mtplx")

# Debian/Ubuntu `libopenblas0-pthread`, then other common layouts.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_state = {"blas": None, "blas_path": None, "reason": None, "warned": False}


def _find_blas() -> Optional[str]:
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def load_fast_blas() -> dict:
    """Load an optimized BLAS globally (Linux only). Idempotent; never raises."""
    if _state["blas"] is not None:
        return dict(_state)
    if sys.platform == "darwin":
        _state.update(blas="accelerate", reason="macOS: MLX uses Metal/Accelerate")
        return dict(_state)
    setting = os.environ.get("MTPLX_BLAS", "").strip()
    if setting.lower() in ("off", "0", "false", "none", "reference"):
        _state.update(blas="reference", reason="disabled by MTPLX_BLAS")
        return dict(_state)
    if "mlx.core" in sys.modules:
        _state.update(blas="unknown", reason="mlx.core was imported before mtplx; BLAS not swapped")
        return dict(_state)
    path = setting or _find_blas()
    if path is None:
        _state.update(blas="reference", reason="no optimized BLAS found (apt install libopenblas0-pthread)")
        return dict(_state)
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _state.update(blas="reference", reason=f"could not load {path}: {exc}")
        return dict(_state)
    _state.update(blas="openblas", blas_path=path, reason=None)
    return dict(_state)


def warn_if_slow_blas() -> None:
    if _state["blas"] == "reference" and not _state["warned"]:
        _state["warned"] = True
        log.warning(
            "mtplx: MLX is using the reference BLAS (%s); CPU decoding will be ~30x slower and "
            "batching gains vanish. Install Debian's libopenblas0-pthread or set MTPLX_BLAS.",
            _state["reason"],
        )


def set_blas_threads(n: Optional[int] = None) -> Optional[int]:
    """Set the BLAS thread count (when `n`) and return the count in effect; None when it cannot be
    controlled (no OpenBLAS, e.g. macOS). OpenBLAS reads OPENBLAS_NUM_THREADS / OMP_NUM_THREADS
    only once, when it is loaded, and a Ray actor process may load it (any import of mtplx) under
    Ray's OMP_NUM_THREADS=1: setting the environment afterwards does nothing, this call does."""
    if _state["blas"] != "openblas" or not _state["blas_path"]:
        return None
    try:
        lib = _state.get("blas_lib") or _state.setdefault("blas_lib", ctypes.CDLL(_state["blas_path"]))
        if n:
            lib.openblas_set_num_threads(int(n))
        return int(lib.openblas_get_num_threads())
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`); False where there is
    none to call. MLX's CPU buffers come from malloc, and glibc keeps freed ones mapped: a replica
    that had served a few hundred requests held ~540 MB resident, of which ~250 MB was free heap
    (measured: 538 MB before a trim, 297 MB after). Costs a walk of the heap; call it when idle."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = _state.get("libc") or _state.setdefault("libc", ctypes.CDLL("libc.so.6"))
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def clear_streams_at_exit() -> None:
    """MLX expects each thread, the main one included, to tear down its own streams before the
    interpreter finalizes; otherwise exit can abort. Registered once, on first model load."""
    if _state.get("atexit"):
        return
    _state["atexit"] = True
    import atexit

    import mlx.core as mx

    atexit.register(mx.clear_streams)


def runtime_info() -> dict:
    """What is live: BLAS, MLX device and versions."""
    import mlx.core as mx

    info = {
        "blas": _state["blas"],
        "blas_path": _state["blas_path"],
        "blas_note": _state["reason"],
        "blas_threads": set_blas_threads(),
        "mlx_version": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import mlx_lm

        info["mlx_lm_version"] = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx_lm is a dependency
        info["mlx_lm_version"] = None
    return info
