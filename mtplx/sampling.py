"""Sampling configuration, target/draft distributions and the speculative acceptance rule.

Distribution order (applied to one row of raw logits, in float64 on the host):
  1. penalties on raw logits, counting completion tokens only:
       logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]
  2. temperature 0 -> one-hot on the argmax (ties break to the lowest id); else softmax(logits / T)
  3. top-p: keep the smallest prefix of tokens sorted by probability (ties by id) whose mass
     reaches top_p (1.0 keeps all)
  4. min-p: drop tokens below min_p * max probability (0 keeps all)
  5. top-k: keep the k most probable (ties by id; 0 keeps all), then renormalise.

Speculative acceptance (Leviathan et al. / Chen et al.): a draft token d sampled from q is accepted
with probability min(1, p(d)/q(d)); on rejection the output is sampled from the residual
normalise(max(p - q, 0)). The output is then distributed exactly as p, whatever q is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

PENALTY_LIMIT = 2.0


@dataclass(frozen=True)
class SamplerConfig:
    """Frozen and hashable, so it can sit in a cohort's compatibility key. MTPLX defaults."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        def bad(name, value, rule):
            raise ValueError(f"SamplerConfig.{name}={value!r} is invalid: {rule}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, value, "must be a finite number")
            object.__setattr__(self, name, float(value))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            bad("top_k", self.top_k, "must be an integer")
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.temperature < 0:
            bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", self.top_k, "must be >= 0 (0 disables top-k)")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > PENALTY_LIMIT:
                bad(name, getattr(self, name), f"must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


GREEDY = SamplerConfig(temperature=0.0)


def token_counts(tokens: Iterable[int], vocab_size: int) -> np.ndarray:
    return np.bincount(np.asarray(list(tokens), dtype=np.int64), minlength=vocab_size)[:vocab_size]


CANDIDATES = 64     # top-p / min-p look at the most probable tokens first (see `_keep_mask`)


def _ranked(probs: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m most probable tokens and every id tied with the m-th, by prob desc then id."""
    n = probs.size
    if m >= n:
        idx = np.arange(n)
    else:
        kth = np.partition(probs, n - m)[n - m]
        idx = np.flatnonzero(probs >= kth)
    return idx[np.lexsort((idx, -probs[idx]))]


def _keep_mask(probs: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """Boolean keep-mask for top-p / min-p / top-k, with ties broken by token id.

    The rules run over the tokens ranked by probability. Ranking the whole vocabulary is a full
    sort per row and per distribution (several per cycle); so they first run over the most probable
    tokens only (top_k of them, or CANDIDATES), and that answer is final when top-k already bounds
    the kept set or when it drops one of those candidates: every token outside them ranks lower and
    is dropped too. Otherwise (the kept set may reach past them) the whole vocabulary is ranked."""
    n = probs.size
    m = cfg.top_k if 0 < cfg.top_k < n else min(CANDIDATES, n)
    total = probs.sum()
    while True:
        order = _ranked(probs, m)
        sorted_p = probs[order]
        keep_sorted = np.ones(order.size, dtype=bool)
        if cfg.top_p < 1.0:
            cum = np.cumsum(sorted_p)
            cutoff = int(np.searchsorted(cum, cfg.top_p * total * (1 - 1e-12))) + 1
            keep_sorted[cutoff:] = False
        if cfg.min_p > 0.0:
            keep_sorted &= sorted_p >= cfg.min_p * sorted_p[0]
        if cfg.top_k > 0:
            keep_sorted[cfg.top_k:] = False
        if order.size == n or not keep_sorted[-1] or 0 < cfg.top_k <= m:
            break
        m = n
    keep = np.zeros(n, dtype=bool)
    keep[order[keep_sorted]] = True
    return keep


def distribution(logits: np.ndarray, cfg: SamplerConfig, counts: Optional[np.ndarray] = None) -> np.ndarray:
    """The sampling distribution (float64, sums to 1) for one row of raw logits."""
    x = np.asarray(logits, dtype=np.float64)
    if cfg.has_penalties and counts is not None:
        x = x - cfg.presence_penalty * (counts > 0) - cfg.frequency_penalty * counts
    if cfg.is_greedy:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    z = x / cfg.temperature
    z = np.exp(z - z.max())
    p = z / z.sum()
    if cfg.top_p < 1.0 or cfg.min_p > 0.0 or (0 < cfg.top_k < p.size):
        p = np.where(_keep_mask(p, cfg), p, 0.0)
        p /= p.sum()
    return p


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw: one uniform per token, so RNG consumption is fixed and reproducible."""
    cum = np.cumsum(probs)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), probs.size - 1))


def verify_one_token(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """Accept `draft` (drawn from q) with prob min(1, p/q); else resample from max(p - q, 0).

    Consumes exactly one uniform on acceptance and two on rejection.
    """
    pd, qd = float(p[draft]), float(q[draft])
    if qd > 0.0 and rng.random() * qd < pd:  # u < p/q without dividing by zero
        return True, int(draft)
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q exactly on the support: any rejection is measure-zero; fall back to p
        return False, sample(p, rng)
    return False, sample(residual / total, rng)


def speculative_output_marginal(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Oracle: the exact output distribution of draft-from-q then verify_one_token against p."""
    accept = np.minimum(p, q)
    residual = np.maximum(p - q, 0.0)
    reject_mass = 1.0 - accept.sum()
    if residual.sum() > 0:
        return accept + reject_mass * residual / residual.sum()
    return accept + reject_mass * p
