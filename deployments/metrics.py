"""Ray metrics recording shared by the ingress and the replica."""

from __future__ import annotations

from typing import Optional


def record(metrics: Optional[dict], name: str, value: float = 1, tags: Optional[dict] = None) -> None:
    """Observe a histogram or increment a counter; metrics never break a request."""
    m = metrics and metrics.get(name)
    if not m:
        return
    try:
        if hasattr(m, "observe"):
            m.observe(value, tags=tags)
        else:
            m.inc(value, tags=tags)
    except Exception:
        pass
