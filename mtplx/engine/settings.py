"""How the engine runs (`EngineSettings`), decided once where a program starts and passed down.

The replica builds one from its app config and its environment (`deployments/replica.py`); a
library user (and `mtplx generate`) builds one or takes the defaults. Below those entry points nothing reads the environment: the lanes, the service and the
ladder take what they are given. Each environment variable (`ENVIRONMENT`) stands in for a field
the entry point was not given; AppArgs (deployments/app.py) documents each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from mtplx.engine.repetition import RepetitionLimits

DRAFT_DRAWS = ("device", "host")
OFF = ("0", "off", "false", "no")        # an on/off variable's off values; anything else set is on
SWITCHES = ("compiled", "overlap", "device_judging", "run_ahead", "context_drafts")    # the on/off fields

# field -> the environment variable an entry point reads for it when the field is not given
ENVIRONMENT = {
    "compiled": "MTPLX_MTP_BATCH_COMPILE",
    "draft_draw": "MTPLX_DRAFT_DRAW",
    "overlap": "MTPLX_OVERLAP",
    "device_judging": "MTPLX_DEVICE_JUDGE",
    "run_ahead": "MTPLX_RUN_AHEAD",
    "context_drafts": "MTPLX_CONTEXT_DRAFTS",
    "force_width": "MTPLX_MTP_BATCH_FORCE_WIDTH",
    "kv_budget_gb": "MTPLX_KV_BUDGET_GB",
}
REPETITION_ENV_PREFIX = "MTPLX_REPETITION_STOP_"   # + MIN_TOKENS, MIN_REPEATED, MIN_REPEATS, MAX_BLOCK


@dataclass(frozen=True)
class EngineSettings:
    # cycle graphs compiled (`mx.compile`): faster on the shipped model (BENCHMARKS.md,
    # "Measurements behind the engine's constants"); each graph's first run is checked eagerly
    compiled: bool = True
    # where sampled rows draw their drafts: on the device, so a cycle waits for it once however
    # many drafts it chains (a mixed service 1.17x the tokens/s against the host, same section)
    draft_draw: str = "device"
    # a running lane launches its next MTP cycle before a step's events go out; None: on a GPU
    # only (MLX's CPU backend computes most of a launch before returning)
    overlap: Optional[bool] = None
    # sampled chains judged on the device; None: on a GPU only (on the CPU the device is the
    # host's core: 0.95-1.05x served)
    device_judging: Optional[bool] = None
    # greedy lanes launch a cycle before the host reads the last one's verify (not a lane whose
    # rows take drafts from their context: those are read on the host, `context_drafts`)
    run_ahead: bool = True
    # greedy rows draft what followed the latest earlier occurrence of their last tokens in their
    # own prompt and output, where there is one and it has been right more often than the head's
    # draft (mtplx.engine.ngram, proposer.ContextScore). Off by default: on Gemma 3 270M it keeps
    # 0.51 of a B8 lane's drafts against the head's 0.31, but its lanes no longer run ahead, which
    # cost as much on this CPU (355 against 325 ms a cycle: equal tok/s; BENCHMARKS.md)
    context_drafts: bool = False
    # the limits a row that arms the repetition stop stops within, and whether every row arms it
    # (the app's `repetition_stop`) or only those whose request asks
    repetition_limits: RepetitionLimits = field(default_factory=RepetitionLimits)
    repetition_stop_all: bool = False
    # the narrowest lane width, pinned (None: the ladder's own)
    force_width: Optional[int] = None
    # decode state all lanes may hold, GiB (None: half the machine's memory)
    kv_budget_gb: Optional[float] = None

    def __post_init__(self):
        if self.draft_draw not in DRAFT_DRAWS:
            raise ValueError(f"draft_draw={self.draft_draw!r} is invalid: expected one of {DRAFT_DRAWS}")
        if self.force_width is not None and (isinstance(self.force_width, bool) or int(self.force_width) != self.force_width):
            raise ValueError(f"force_width={self.force_width!r} is invalid: must be an integer width")
        if not isinstance(self.repetition_limits, RepetitionLimits):
            raise TypeError(f"repetition_limits={self.repetition_limits!r} is invalid: a RepetitionLimits "
                            "(repetition_stop_all=False leaves rows unarmed)")
        if self.kv_budget_gb is not None and not float(self.kv_budget_gb) > 0:
            raise ValueError(f"kv_budget_gb={self.kv_budget_gb!r} is invalid: must be above 0 GiB")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], **given) -> "EngineSettings":
        """The settings `given` (None: not given), else the environment's (`ENVIRONMENT`), else the
        defaults. Called by entry points only, with their process's environment."""
        values = {}
        for name, var in ENVIRONMENT.items():
            if given.get(name) is not None:
                values[name] = given[name]
            elif environ.get(var, "").strip():
                values[name] = _parse(name, var, environ[var].strip())
        limits = given.get("repetition_limits")
        values["repetition_limits"] = limits if limits is not None else _repetition_limits(environ)
        if given.get("repetition_stop_all") is not None:
            values["repetition_stop_all"] = bool(given["repetition_stop_all"])
        unknown = set(given) - set(ENVIRONMENT) - {"repetition_limits", "repetition_stop_all"}
        if unknown:
            raise TypeError(f"unknown engine settings: {sorted(unknown)}")
        return cls(**values)

    def lane_overlap(self) -> bool:
        return self.overlap if self.overlap is not None else _on_gpu()

    def lane_device_judging(self) -> bool:
        return self.device_judging if self.device_judging is not None else _on_gpu()

    def kv_budget_bytes(self) -> Optional[int]:
        """The decode-state budget in bytes: `kv_budget_gb`, else half the machine's memory (None
        where it cannot be read: no budget)."""
        if self.kv_budget_gb is not None:
            return int(float(self.kv_budget_gb) * 2**30)
        import os

        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):
            return None


def _on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def _parse(name: str, var: str, raw: str):
    if name in SWITCHES:
        return raw.lower() not in OFF
    if name == "draft_draw":
        if raw.lower() not in DRAFT_DRAWS:
            raise ValueError(f"{var}={raw!r} is invalid: expected one of {DRAFT_DRAWS}")
        return raw.lower()
    try:
        return int(raw) if name == "force_width" else float(raw)
    except ValueError:
        what = "an integer width" if name == "force_width" else "a number of GiB"
        raise ValueError(f"{var}={raw!r} is invalid: must be {what}") from None


def _repetition_limits(environ: Mapping[str, str]) -> RepetitionLimits:
    values = {}
    for name in ("min_tokens", "min_repeated", "min_repeats", "max_block"):
        var = REPETITION_ENV_PREFIX + name.upper()
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is invalid: must be an integer") from None
        if value < 1:
            raise ValueError(f"{var}={value} is invalid: must be >= 1")
        values[name] = value
    return RepetitionLimits(**values)
