"""Our Grafana panels inside the Grafana that Ray provisions, so the Ray dashboard shows cohort stats.

Ray (2.60) writes, per session, a Grafana provisioning folder whose dashboards folder Grafana loads
whole, and its dashboard's Metrics tab embeds Ray's Core dashboard (uid `rayDefaultDashboard`,
file `default_grafana_dashboard.json`) and nothing else. So at each app start we
- write the mtplx dashboard (`serve_configs/grafana_mtplx_dashboard.json`) into that folder, and
- add an "mtplx cohorts" row (acceptance, occupancy, queue, tokens/s, TTFT, lanes by route) at the
  top of the Core dashboard there, with panel ids above Ray's own.
Ray rewrites those files when a session starts, so this is re-applied on every app start. The folder
is `RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR` when set (as Ray reads it), else
`<RAY_METRICS_OUTPUT_ROOT or the session folder's metrics>/grafana/dashboards`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import List, Optional

DASHBOARD_FILE = Path(__file__).resolve().parents[1] / "serve_configs" / "grafana_mtplx_dashboard.json"
CORE_DASHBOARD_FILE = "default_grafana_dashboard.json"     # Ray's Core dashboard (uid rayDefaultDashboard)
OUR_DASHBOARD_FILE = "mtplx_grafana_dashboard.json"
ROW_TITLE = "mtplx cohorts"
ROW_MARK = "Added by mtplx at app start."                   # how a re-run finds what it added before
# the shipped dashboard's panels that the Core dashboard's row shows, in order (two a line: six
# fill three lines; the lanes by route show split lanes where the Ray dashboard's Metrics tab looks)
ROW_PANELS = ("Draft acceptance rate", "Lane occupancy (live rows per cycle)", "Waiting rows by lane",
              "Generated tokens/s by replica", "Time to first token", "Running lanes and their rows by route")
PANEL_H, PANEL_W = 8, 12


def load_dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def dashboards_dir(session_dir: Optional[str] = None) -> Optional[Path]:
    """The folder Ray's Grafana provisioning loads dashboards from, as Ray computes it."""
    if os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"):
        return Path(os.environ["RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"])
    if os.environ.get("RAY_METRICS_OUTPUT_ROOT"):
        return Path(os.environ["RAY_METRICS_OUTPUT_ROOT"]) / "grafana" / "dashboards"
    if session_dir is None:
        try:
            from ray._private import worker

            session_dir = worker._global_node.get_session_dir_path()
        except Exception:
            return None
    return Path(session_dir) / "metrics" / "grafana" / "dashboards"


def _all_panels(panels: list) -> list:
    """Panels with those nested in collapsed rows."""
    out = []
    for p in panels:
        out.append(p)
        out.extend(p.get("panels") or ())
    return out


def _bottom(p: dict) -> int:
    g = p.get("gridPos") or {}
    return int(g.get("y", 0)) + int(g.get("h", 0))


def _is_ours(p: dict) -> bool:
    return ROW_MARK in (p.get("description") or "")


def with_cohort_row(core: dict, ours: dict) -> dict:
    """Ray's Core dashboard with an "mtplx cohorts" row at its top (a previous row of ours replaced):
    our panels get ids above every id of Ray's, and Ray's panels move down to make room."""
    core = copy.deepcopy(core)
    theirs = [p for p in core.get("panels", []) if not _is_ours(p)]
    ours_top = max((_bottom(p) for p in core.get("panels", []) if _is_ours(p)), default=0)
    by_title = {p["title"]: p for p in ours["panels"]}
    picked = [by_title[t] for t in ROW_PANELS]
    next_id = max((int(p.get("id", 0)) for p in _all_panels(theirs)), default=0) + 1
    added: List[dict] = [{"id": next_id, "type": "row", "title": ROW_TITLE, "collapsed": False, "panels": [],
                          "description": ROW_MARK, "gridPos": {"x": 0, "y": 0, "w": 24, "h": 1}}]
    for i, src in enumerate(picked):
        p = copy.deepcopy(src)
        p["id"] = next_id + 1 + i
        p["description"] = f"{ROW_MARK} From the mtplx dashboard ({DASHBOARD_FILE.name})."
        p["gridPos"] = {"x": (i % 2) * PANEL_W, "y": 1 + (i // 2) * PANEL_H, "w": PANEL_W, "h": PANEL_H}
        added.append(p)
    height = max(_bottom(p) for p in added)
    for p in _all_panels(theirs):          # Ray's panels below ours (undo the shift of a previous run)
        g = p.setdefault("gridPos", {"x": 0, "y": 0, "w": 24, "h": 1})
        g["y"] = int(g.get("y", 0)) - ours_top + height
    core["panels"] = added + theirs
    return core


def provision(directory: Optional[Path] = None, log: Optional[logging.Logger] = None) -> Optional[dict]:
    """Write our dashboard into Ray's Grafana dashboards folder and our row into its Core dashboard.
    Does nothing (returns None) where Ray wrote no such folder (no dashboard in this session, or
    another node). Returns what it wrote."""
    directory = directory or dashboards_dir()
    if directory is None or not directory.is_dir():
        return None
    ours = load_dashboard()
    (directory / OUR_DASHBOARD_FILE).write_text(json.dumps(ours, indent=2))
    written = {"dashboard": str(directory / OUR_DASHBOARD_FILE), "core_row": None}
    core_path = directory / CORE_DASHBOARD_FILE
    if core_path.is_file():
        core = with_cohort_row(json.loads(core_path.read_text()), ours)
        tmp = core_path.with_suffix(".mtplx.tmp")
        tmp.write_text(json.dumps(core, indent=2))
        os.replace(tmp, core_path)          # Grafana never reads half a file
        written["core_row"] = str(core_path)
    if log is not None:
        log.info("mtplx: Grafana dashboard and Core-dashboard row written: %s", written)
    return written
