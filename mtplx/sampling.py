"""Sampling configuration, target/draft distributions and the speculative acceptance rule.

Distribution order (applied to one row of raw logits; float32 logits, float64 masses):
  1. penalties on raw logits, counting completion tokens only:
       logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]
  2. temperature 0 -> one-hot on the argmax (ties break to the lowest id); else the weights
       z[t] = exp((logit[t] - max logit) / T)   (float32), total Z = sum of z (float64)
  3. top-p: keep the smallest prefix of tokens sorted by weight (ties by id) whose mass
     reaches top_p * Z (1.0 keeps all)
  4. min-p: drop tokens below min_p * max weight (0 keeps all)
  5. top-k: keep the k heaviest (ties by id; 0 keeps all), then renormalise over the kept tokens.

A filtered distribution is held sparse (`Distribution`: the kept ids and their probabilities), and
is built from the heaviest tokens only, which is exact (see `row_distribution`): a 248,320-token
row costs a few passes over float32 logits instead of sorting the vocabulary in float64.

Speculative acceptance (Leviathan et al. / Chen et al.): a draft token d sampled from q is accepted
with probability min(1, p(d)/q(d)); on rejection the output is sampled from the residual
normalise(max(p - q, 0)). The output is then distributed exactly as p, whatever q is.

Drafts drawn on the device (`device_draft_draw`): since any q keeps p exact, a lane may draw its
drafts on the device without waiting for the draft logits, from a q the host learns exactly
afterwards (`device_draft_distribution`): the draft sampler over the row's DRAFT_CANDIDATES
heaviest tokens, drawn by inverse CDF at a uniform of UNIFORM_BITS bits from the row's own RNG.

Chains judged on the device (`acceptor.DeviceVerdicts`): a row with a top-k within
DRAFT_CANDIDATES and no penalties is judged where its logits are, against its target over its
heaviest tokens (`device_target_candidates`), with uniforms of UNIFORM_BITS bits drawn at launch
from its own RNG; the host reads its drafts kept and next token. In float32: a token whose mass
before it is within float32's rounding of top_p may fall on the other side of the cut, and an
accept probability is realised to within 2**-24.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

PENALTY_LIMIT = 2.0
DRAFT_CANDIDATES = 64      # a device-drawn draft's q: the draft sampler over the row's heaviest tokens
UNIFORM_BITS = 24          # a device draw's uniform: m / 2**24, exact in float32
GREEDY_BELOW = 1e-5        # a temperature below this decodes greedy (as vLLM's sampling epsilon)
# What the device's float32 columns hold (`_column`): a top_p below float32's smallest normal
# number rounds to 0 there (or a GPU flushes it to 0) and keeps no token; a temperature above
# float32's largest is infinite there; a top_k beyond int32 is no top_k an engine holds.
FLOAT32_TINY = 2.0 ** -126             # float32's smallest normal number (1.1754944e-38)
FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127
TOP_K_MAX = 2 ** 31 - 1


# Each setting's range, and what the refusal says. top_p's and temperature's ends are what the
# device's float32 columns hold; top_k's, int32's.
SETTING_RANGES = {
    "temperature": (0.0, FLOAT32_MAX, f"must be >= 0 (0 means greedy) and at most {FLOAT32_MAX:.7g} (float32's "
                                      f"largest number)"),
    "top_p": (FLOAT32_TINY, 1.0, f"must be in (0, 1], and at least {FLOAT32_TINY:.8g} (float32's smallest normal "
                                 f"number: below it the device's float32 rounds top_p to 0, or a GPU flushes it to "
                                 f"0, and keeps no token); for greedy decoding use temperature 0"),
    "top_k": (0, TOP_K_MAX, f"must be >= 0 (0 disables top-k) and at most {TOP_K_MAX} (int32); any top_k at or "
                            f"above the vocabulary size keeps every token, as 0 does"),
    "min_p": (0.0, 1.0, "must be in [0, 1]"),
    "presence_penalty": (-PENALTY_LIMIT, PENALTY_LIMIT, f"must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]"),
    "frequency_penalty": (-PENALTY_LIMIT, PENALTY_LIMIT, f"must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]"),
}


def _refuse(name: str, value, rule: str):
    raise ValueError(f"SamplerConfig.{name}={shown_value(value)} is invalid: {rule}")


def shown_value(value) -> str:
    """A value as an error message shows it: repr, but an integer too long to read (or to print:
    Python refuses ints of more than 4300 digits) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


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
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _refuse(name, value, "must be a finite number")
            object.__setattr__(self, name, float(value))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            _refuse("top_k", self.top_k, "must be an integer")
        object.__setattr__(self, "top_k", int(self.top_k))
        for name, (lo, hi, rule) in SETTING_RANGES.items():
            if not lo <= getattr(self, name) <= hi:
                _refuse(name, getattr(self, name), rule)
        if self.temperature < GREEDY_BELOW:   # logits / 1e-320 overflow to a NaN distribution
            object.__setattr__(self, "temperature", 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


GREEDY = SamplerConfig(temperature=0.0)


def token_counts(tokens: Iterable[int], vocab_size: int) -> np.ndarray:
    return np.bincount(np.asarray(list(tokens), dtype=np.int64), minlength=vocab_size)[:vocab_size]


def to_host(logits) -> np.ndarray:
    """Logits on the host as float32 (cast on the device first: numpy cannot read bfloat16)."""
    import mlx.core as mx

    if isinstance(logits, mx.array):
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        return np.asarray(logits)
    return np.asarray(logits, dtype=np.float32)


class Distribution:
    """One row's sampling distribution: probabilities `probs` (float64, summing to 1) over the
    kept token ids `ids` (ascending), or over the whole vocabulary when `ids` is None."""

    __slots__ = ("ids", "probs", "vocab")

    def __init__(self, ids: Optional[np.ndarray], probs: np.ndarray, vocab: int):
        self.ids, self.probs, self.vocab = ids, probs, vocab

    @classmethod
    def point(cls, token: int, vocab: int) -> "Distribution":
        return cls(np.array([token], dtype=np.int64), np.ones(1), vocab)

    @classmethod
    def from_dense(cls, probs: np.ndarray) -> "Distribution":
        probs = np.asarray(probs, dtype=np.float64)
        ids = np.flatnonzero(probs > 0)
        return cls(ids, probs[ids] / probs[ids].sum(), probs.size)

    def prob(self, token: int) -> float:
        return float(self.probs_at(np.array([token]))[0])

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        if self.ids is None:
            return self.probs[tokens]
        i = np.minimum(np.searchsorted(self.ids, tokens), self.ids.size - 1)
        return np.where(self.ids[i] == tokens, self.probs[i], 0.0)

    def dense(self) -> np.ndarray:
        if self.ids is None:
            return self.probs.copy()
        out = np.zeros(self.vocab)
        out[self.ids] = self.probs
        return out

    def draw(self, u: float) -> int:
        """Inverse CDF over ascending ids at uniform u (the same token a dense draw picks)."""
        return inverse_cdf(self.probs, u, self.ids)


def inverse_cdf(weights: np.ndarray, u: float, ids: Optional[np.ndarray] = None) -> int:
    cum = np.cumsum(weights)
    i = int(min(np.searchsorted(cum, u * cum[-1], side="right"), weights.size - 1))
    return i if ids is None else int(ids[i])


CANDIDATE_FLOOR = 1e-4   # first candidate set: weights at least 1e-4 of the heaviest


def _penalised(x: np.ndarray, cfg: SamplerConfig, counts) -> np.ndarray:
    if not cfg.has_penalties or counts is None or not len(counts):
        return x
    if isinstance(counts, dict):
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
    else:
        ids = np.flatnonzero(counts)
        n = np.asarray(counts, dtype=np.float64)[ids]
    x = x.copy()
    x[ids] -= (cfg.presence_penalty * (n > 0) + cfg.frequency_penalty * n).astype(np.float32)
    return x


def _weights(x: np.ndarray, top: float, cfg: SamplerConfig) -> np.ndarray:
    """exp((x - top) / T) in float32, in one buffer."""
    z = np.subtract(x, np.float32(top))
    np.multiply(z, np.float32(1.0 / cfg.temperature), out=z)
    return np.exp(z, out=z)


def _at_least(z: np.ndarray, floor: float) -> np.ndarray:
    """Ids of the weights at or above `floor`; at floor 0, of the positive ones."""
    return np.flatnonzero(z >= np.float32(floor)) if floor > 0.0 else np.flatnonzero(z)


def row_distribution(logits, cfg: SamplerConfig, counts=None) -> Distribution:
    """The sampling distribution of one row of raw logits (float32 on the host, or an MLX array).

    Filtered configs rank only the heaviest tokens: the candidates are every token whose weight is
    at least `floor` (a set closed under ties, so ranking it by weight then id ranks a prefix of
    the whole vocabulary exactly). The rules run over the candidates; their answer is the whole
    vocabulary's when top-k fits inside them, when they drop their last candidate (every token
    outside ranks lower and is dropped too), or when the floor is min_p (min-p drops every token
    below it: the heaviest weighs exactly 1). Otherwise the floor drops and the rules run again.
    `counts`: completion-token counts (dict or dense array)."""
    x = _penalised(to_host(logits).reshape(-1), cfg, counts)
    V = x.size
    if cfg.is_greedy:
        return Distribution.point(int(np.argmax(x)), V)
    z_all = _weights(x, float(x[np.argmax(x)]), cfg)
    if not (cfg.top_p < 1.0 or cfg.min_p > 0.0 or 0 < cfg.top_k < V):
        z = z_all.astype(np.float64)
        return Distribution(None, z / z.sum(), V)
    total = float(z_all.sum(dtype=np.float64))
    # tokens of weight 0 (masked to -inf by a grammar, or underflowed) are never drawn: the
    # ranking is complete once the candidates hold every token of positive weight
    support = int(np.count_nonzero(z_all))
    floor = max(CANDIDATE_FLOOR, cfg.min_p)
    while True:
        cand = _at_least(z_all, floor)
        if 0 < cfg.top_k < cand.size:
            # top-k keeps none below the k-th heaviest weight: rank only the candidates at or above
            # it (still closed under ties, so still a prefix of the whole ranking)
            kth = np.partition(z_all[cand], cand.size - cfg.top_k)[cand.size - cfg.top_k]
            cand = cand[z_all[cand] >= kth]
        z = z_all[cand]
        order = np.lexsort((cand, -z))
        cand, zs = cand[order], z[order].astype(np.float64)
        keep = np.ones(cand.size, dtype=bool)
        if cfg.top_p < 1.0:
            cum = np.cumsum(zs)
            keep[int(np.searchsorted(cum, cfg.top_p * total * (1 - 1e-12))) + 1:] = False
        if cfg.min_p > 0.0:
            keep &= zs >= cfg.min_p * zs[0]
        if cfg.top_k > 0:
            keep[cfg.top_k:] = False
        if cand.size == support or not keep[-1] or 0 < cfg.top_k <= cand.size or floor <= cfg.min_p:
            break
        floor = floor ** 4 if floor > 1e-30 else 0.0
    ids, w = cand[keep], zs[keep]
    by_id = np.argsort(ids)
    return Distribution(ids[by_id], w[by_id] / w.sum(), V)


def distribution(logits, cfg: SamplerConfig, counts=None) -> np.ndarray:
    """`row_distribution` as a dense float64 vector over the vocabulary (reference and tests)."""
    return row_distribution(logits, cfg, counts).dense()


def sample(dist, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from a `Distribution` or a dense probability vector: one uniform per
    token, so RNG consumption is fixed and reproducible."""
    if isinstance(dist, Distribution):
        return dist.draw(rng.random())
    return inverse_cdf(np.asarray(dist, dtype=np.float64), rng.random())


def draws_on_device(cfg: SamplerConfig) -> bool:
    """Whether a draft from `cfg` can be drawn on the device (penalties need the row's token counts,
    which live on the host)."""
    return not cfg.is_greedy and not cfg.has_penalties


def draft_uniform(rng: np.random.Generator) -> int:
    """The integer m of a device draw's uniform m / 2**UNIFORM_BITS (one draw from the row's RNG)."""
    return int(rng.integers(0, 1 << UNIFORM_BITS))


def device_draft_draw(logits, cfgs, m: np.ndarray):
    """One draft per row, drawn on the device without a wait: row b's draft sampler `cfgs[b]`
    (temperature, top_p over the candidates' mass, min_p, top_k) over its K heaviest tokens, then
    the first candidate whose normalised cumulative weight t exceeds m[b] / 2**UNIFORM_BITS.
    Returns lazy (drafts [W] uint32, candidate ids [W, K], thresholds t [W, K] float32); the ids and
    thresholds give the host the exact q (`device_draft_distribution`)."""
    import mlx.core as mx

    ids, v = _heaviest(logits.astype(mx.float32))
    w = mx.exp((v - v[:, :1]) / _column(cfgs, "temperature"))                # the heaviest weighs 1
    keep = _kept_prefix(w, cfgs)
    kept = mx.cumsum(mx.where(keep, w, 0.0), axis=-1)
    t = kept / kept[:, -1:]
    u = mx.array((np.asarray(m, dtype=np.float64) / (1 << UNIFORM_BITS)).astype(np.float32))[:, None]
    j = (t <= u).astype(mx.int32).sum(axis=-1, keepdims=True)
    drafts = mx.take_along_axis(ids, j, axis=-1)[:, 0].astype(mx.uint32)
    return drafts, ids, t


def _heaviest(x):
    """Each row's DRAFT_CANDIDATES heaviest ids and logits [N, K], heaviest first (lazy)."""
    import mlx.core as mx

    N, V = x.shape
    K = min(DRAFT_CANDIDATES, V)
    ids = mx.argpartition(-x, K - 1, axis=-1)[:, :K] if K < V else mx.broadcast_to(mx.arange(V), (N, V))
    order = mx.argsort(-mx.take_along_axis(x, ids, axis=-1), axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    return ids, mx.take_along_axis(x, ids, axis=-1)


def _column(cfgs, name: str):
    import mlx.core as mx

    return mx.array(np.array([getattr(c, name) for c in cfgs], dtype=np.float32))[:, None]


def _kept_prefix(w, cfgs, total=None):
    """Over weights sorted heaviest first (the heaviest weighing 1), what top-p (of `total`, else
    of these weights' sum), min-p and top-k keep of each row: a prefix, never empty (top_p 1 keeps
    every token: a float32 sum stops growing before the lightest ones)."""
    import mlx.core as mx

    cum = mx.cumsum(w, axis=-1)
    before = mx.concatenate([mx.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    top_k, top_p = _column(cfgs, "top_k"), _column(cfgs, "top_p")
    total = cum[:, -1:] if total is None else total
    return (((top_p >= 1.0) | (before < top_p * total)) & (w >= _column(cfgs, "min_p"))
            & ((top_k == 0) | (mx.arange(w.shape[-1])[None, :] < top_k)))


def judged_on_device(cfg: SamplerConfig) -> bool:
    """Whether a row sampling from `cfg` can be judged on the device (`device_target_candidates`):
    no penalties (their counts live on the host), and a top-k within the candidates."""
    return not cfg.is_greedy and not cfg.has_penalties and 0 < cfg.top_k <= DRAFT_CANDIDATES


def device_target_candidates(logits, cfgs, exp=None):
    """Each row's target distribution (`judged_on_device` configs) on the device, lazy: (ids,
    probs) [N, K] over its DRAFT_CANDIDATES heaviest tokens, which hold all top-k keeps. The
    order above in float32 (top-p over the whole vocabulary's weight); a token tied with the
    lightest kept one may take its place (the host breaks such ties by id). `exp`: the
    exponential of non-positive float32 (None: MLX's)."""
    import mlx.core as mx

    x = logits.astype(mx.float32)
    inverse_t = mx.array(np.array([1.0 / c.temperature for c in cfgs], dtype=np.float32))[:, None]
    w_all = (exp or mx.exp)((x - mx.max(x, axis=-1, keepdims=True)) * inverse_t)   # as the host's `_weights`
    ids, _ = _heaviest(x)                     # heaviest logits first: heaviest weights first
    w = mx.take_along_axis(w_all, ids, axis=-1)
    kept = mx.where(_kept_prefix(w, cfgs, w_all.sum(axis=-1, keepdims=True)), w, 0.0)
    return ids, kept / kept.sum(axis=-1, keepdims=True)


def device_draft_masses(t):
    """The q masses of device draws' candidates [N, K] (lazy): `device_draft_distribution`'s."""
    import mlx.core as mx

    scale = float(1 << UNIFORM_BITS)
    edges = mx.ceil(mx.minimum(mx.sort(t, axis=-1), 1.0) * scale)
    return (edges - mx.concatenate([mx.zeros_like(edges[:, :1]), edges[:, :-1]], axis=-1)) / scale


def device_inverse_cdf(weights, u):
    """`inverse_cdf` of each row of `weights` [N, K] at its uniform u [N] (lazy indices [N])."""
    import mlx.core as mx

    cum = mx.cumsum(weights, axis=-1)
    at = (cum <= u[:, None] * cum[:, -1:]).astype(mx.int32).sum(axis=-1)
    return mx.minimum(at, weights.shape[-1] - 1)


def device_draft_distribution(ids: np.ndarray, t: np.ndarray, vocab: int, m: int) -> tuple:
    """(q, draft) of one row's device draw from its candidate ids and thresholds: the draw takes
    candidate j = #{i: t[i] <= u} at u = m / 2**UNIFORM_BITS, so with t sorted, candidate j is taken
    for exactly ceil(2**b t[j]) - ceil(2**b t[j-1]) of the 2**b values of m (t need not come back
    monotone from a parallel scan; sorting it gives the same counts)."""
    scale = float(1 << UNIFORM_BITS)
    t = np.asarray(t, dtype=np.float64)
    j = int(np.count_nonzero(t <= m / scale))
    edges = np.ceil(np.minimum(np.sort(t), 1.0) * scale)
    mass = np.diff(edges, prepend=0.0) / scale
    ids = np.asarray(ids, dtype=np.int64)
    nz = mass > 0
    by_id = np.argsort(ids[nz])
    return Distribution(ids[nz][by_id], mass[nz][by_id], vocab), int(ids[j])
