"""The fixed-width batched MTP lane: many requests decoded as one cohort.

Each cycle, for all rows at once: one MTP head forward [B, 2] (the row's owed history entry, if
any, and the draft entry (h_last, primary)), one target verify forward [B, 2] = [primary, draft],
then a per-row decision with the row's own RNG in the solo path's order (primary, draft,
accept/residual, bonus), and a per-row commit of 0, 1 or 2 positions into ragged caches. Rows are
prefilled one by one at their own length (no padding tokens), then merged. Finished, cancelled
and padding rows stay in the batch, inert (keep 0), until the cohort drains.

The lane name and route ids follow MTPLX's A3B lane; the lane here is architecture-neutral.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .generation import CapacityError, PREFILL_CHUNK, prefill
from .models.cache import RaggedKVCache, commit_rows
from .sampling import SamplerConfig, distribution, sample, verify_one_token

DEPTH = 1
VERIFY_T = 2
MIN_WIDTH, MAX_WIDTH = 2, 16
NUMERICS_PROFILES = ("throughput", "b1-exact")


class A3BMTPBatchCapacityError(CapacityError):
    """A row's prompt + max_tokens exceeds the model's context window."""


class LaneSelfCheckError(RuntimeError):
    """The lane's numerical self-check failed; the lane was not installed."""


def _noop(*_args, **_kwargs):
    return None


def _never() -> bool:
    return False


@dataclass(frozen=True)
class A3BMTPBatchRequest:
    request_id: str
    prompt_ids: tuple
    sampler: SamplerConfig = SamplerConfig(temperature=0.0)
    draft_sampler: Optional[SamplerConfig] = None      # None mirrors the target sampler
    seed: int = 0
    max_tokens: int = 64
    stop_token_ids: frozenset = frozenset()
    omit_speculative_bonus: bool = False
    on_token: Callable[[int], None] = _noop
    on_decode_start: Callable[[], None] = _noop
    on_terminal: Callable[[str, int], None] = _noop
    cancelled: Callable[[], bool] = _never
    repetition_stop: bool = False
    session_restore: Optional[Callable[[], object]] = None
    session_commit: Optional[Callable[..., None]] = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))


@dataclass
class A3BMTPBatchStreamResult:
    request_id: str
    tokens: list = field(default_factory=list)
    finish_reason: Optional[str] = None             # "stop" | "length" | "cancelled"
    cycles: int = 0
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    terminal_perf_s: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class A3BMTPBatchResult:
    streams: list
    cycles: int
    accepted_drafts: int
    rejected_drafts: int
    route_id: str
    width_histogram: dict
    real_width: int
    fixed_width: int
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class InstalledA3BMTPBatchLane:
    model: object = field(repr=False, compare=False)
    width: int
    depth: int
    verify_t: int
    numerics: str
    route_id: str
    config_fingerprint: str
    selfcheck: dict = field(compare=False)
    prefill_chunk: int = PREFILL_CHUNK
