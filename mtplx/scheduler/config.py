"""The scheduler's defaults, each in one place: the app's config (`deployments.app.AppArgs`), the
replica and the service import them from here, and the checks that name the setting at fault (the
engine's own settings, and the environment variables that stand in for them where a program starts:
`mtplx.engine.settings`).

Plain Python with no MLX import: the app builder reads these in processes that never load a model.
"""

from __future__ import annotations


DEFAULT_WIDTHS = (3, 8, 16, 32)        # lane widths installed; a running lane moves between them
# Drafts greedy rows chain a cycle, by lane width: the app's and the replica's default chooses each
# width's depth by its measured cycle cost (`ladder.choose_depth`); a {width: depth} dict overrides.
# The library service chains 1 unless it is given these.
GREEDY_DEPTHS_BY_COST = "cost"
# Drafts a sampled row chains a cycle at every width: the app's and the replica's default (the
# library service's is 1). On this project's CPU a B8 lane of t0.6 rows made 1.08x the tokens/s at
# depth 2 as at 1, and 0.97x at 3 (BENCHMARKS.md, "Measurements behind the engine's constants").
DEFAULT_SAMPLED_DEPTH = 2
DEFAULT_BATCH_WAIT_S = 0.02            # a lone submit's wait for company (submit_cohort: none)
MAX_COHORT_ROWS = 8                    # MTPLX's seal cap; here the row cap when no lane is installed
IDLE_HEAP_RELEASE_S = 0.5              # idle this long after work, the owner returns free heap to the OS
NUMERICS = ("throughput", "b1-exact")


def checked_greedy_depths(depths, widths_max: int, depths_allowed: tuple) -> dict:
    """`greedy_depths` as {width: depth}, or ValueError naming the entry at fault."""
    out = {}
    for w, d in dict(depths or {}).items():
        if isinstance(d, bool) or int(d) != d or int(d) not in depths_allowed:
            raise ValueError(f"greedy_depths[{w}]={d!r} is invalid: a lane chains {depths_allowed} drafts")
        if isinstance(w, bool) or int(w) != float(w) or not 1 <= int(w) <= widths_max:
            raise ValueError(f"greedy_depths has width {w!r}: widths are integers in [1, {widths_max}]")
        out[int(w)] = int(d)
    return out

