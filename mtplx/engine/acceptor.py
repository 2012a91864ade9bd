"""The acceptor: which of a row's drafts the target keeps. Greedy rows keep a draft equal to the
target's argmax; sampled rows keep it with probability min(1, p/q) and at the first rejection
draw from the residual max(p - q, 0), so every kept token follows the target distribution p
(speculative sampling; Leviathan et al., Chen et al.). Drafts are judged left to right; the
first rejection ends the chain."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from mtplx.models.cpu_ops import exp_nonpositive
from mtplx.sampling import (DRAFT_CANDIDATES, UNIFORM_BITS, Distribution, device_draft_masses, device_inverse_cdf,
                            device_target_candidates, draft_uniform, inverse_cdf, judged_on_device, sample, to_host)


def verify_one_token(p, q, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """Accept `draft` (drawn from q) with prob min(1, p/q); else resample from max(p - q, 0).
    p and q are `Distribution`s or dense probability vectors.

    Consumes exactly one uniform on acceptance and two on rejection.
    """
    p = p if isinstance(p, Distribution) else Distribution.from_dense(p)
    q = q if isinstance(q, Distribution) else Distribution.from_dense(q)
    pd, qd = p.prob(draft), q.prob(draft)
    if qd > 0.0 and rng.random() * qd < pd:  # u < p/q without dividing by zero
        return True, int(draft)
    ids = p.ids if p.ids is not None else np.arange(p.vocab)
    residual = np.maximum(p.probs - q.probs_at(ids), 0.0)
    if residual.sum() <= 0.0:  # p == q exactly on the support: any rejection is measure-zero; fall back to p
        return False, p.draw(rng.random())
    return False, inverse_cdf(residual, rng.random(), ids)


def speculative_output_marginal(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Oracle: the exact output distribution of draft-from-q then verify_one_token against p."""
    accept = np.minimum(p, q)
    residual = np.maximum(p - q, 0.0)
    reject_mass = 1.0 - accept.sum()
    if residual.sum() > 0:
        return accept + reject_mass * residual / residual.sum()
    return accept + reject_mass * p


class Targets:
    """A verify forward's answer for every row b and verify position j, as the acceptor reads it:
    the argmax ids [W, T] (read on the device) for greedy rows; the chain verdicts of sampled
    rows judged on the device (`DeviceVerdicts`); for any other row its own distribution from
    the logits [W, T, V], read to the host only when a row asks (each with its own RNG)."""

    def __init__(self, vocab: int, ids: np.ndarray, device_logits, allowed: Optional[dict] = None,
                 verdicts: Optional[dict] = None):
        self.vocab, self.ids, self.device_logits = vocab, ids, device_logits
        self.logits: Optional[np.ndarray] = None    # the host's copy, once a row asked for it
        self.allowed = allowed or {}      # sampled constrained rows: b -> [its grammar's mask at each position]
        self.verdicts = verdicts or {}    # rows judged on the device: b -> (drafts kept, next token)

    def host_logits(self) -> np.ndarray:
        if self.logits is None:
            self.logits = to_host(self.device_logits)
        return self.logits

    def p(self, row, b: int, j: int):
        """Row b's target distribution at position j, restricted to what its grammar allows there
        (a greedy constrained row's grammar is at position j's state when it is judged)."""
        if row.grammar is not None and row.greedy:
            return Distribution.point(self.token(row, b, j), self.vocab)
        masks = self.allowed.get(b)
        return row.dist(self.host_logits()[b, j], allowed=None if masks is None else masks[j])

    def token(self, row, b: int, j: int) -> int:
        """The target's own token at position j: row b's next token when it keeps no further draft."""
        if b in self.verdicts:
            return self.verdicts[b][1]
        if row.greedy:
            token = int(self.ids[b, j])
            return token if row.grammar is None else row.constrained_argmax(token, lambda: self.host_logits()[b, j])
        return sample(self.p(row, b, j), row.rng)

    def judge(self, row, b: int, j: int, draft: int, q: Optional[Distribution]) -> tuple[bool, int]:
        """(kept, token): the draft at position j kept, or the token the row takes instead. `q`: the
        draft's distribution (None: a point mass, the head's argmax)."""
        if b in self.verdicts:
            kept, token = self.verdicts[b]
            return (True, draft) if j < kept else (False, token)
        if row.greedy:
            target = self.token(row, b, j)
            return draft == target, target
        q = q if q is not None else Distribution.point(draft, self.vocab)
        return verify_one_token(self.p(row, b, j), q, draft, row.rng)


def device_verdicts(P_ids, P, Q_ids, Q, drafts, u, v, depth):
    """Rows' chains judged on the device (lazy). The target's distribution at each verify position
    over its candidates, ids `P_ids` and masses `P` [N, T, K]; each draft's q likewise, `Q_ids`
    and `Q` [N, T - 1, Kq] (an id outside the vocabulary pads); `drafts` [N, T - 1]; accept
    uniforms `u` [N, T - 1] and draw uniforms `v` [N, T]; `depth` [N] the drafts each row
    chained. Returns (kept [N], token [N]): the longest prefix of drafts with u_j q(d_j) < p(d_j)
    (`verify_one_token`'s test), and the row's next token, drawn by inverse CDF at v[kept] from
    the residual max(p - q, 0) at the first rejection (p where that is empty) or, after a kept
    chain, from p at the position after it (the bonus)."""
    import mlx.core as mx

    T = P.shape[1]
    d = drafts.astype(P_ids.dtype)[..., None]
    pd = mx.where(P_ids[:, :-1] == d, P[:, :-1], 0.0).sum(axis=-1)
    qd = mx.where(Q_ids == d, Q, 0.0).sum(axis=-1)
    ok = (u * qd < pd) & (mx.arange(T - 1)[None, :] < depth[:, None])
    kept = mx.cumprod(ok.astype(mx.int32), axis=-1).sum(axis=-1)
    q_at_p = mx.where(P_ids[:, :-1, :, None] == Q_ids[:, :, None, :], Q[:, :, None, :], 0.0).sum(axis=-1)
    residual = mx.maximum(P[:, :-1] - q_at_p, 0.0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, P[:, :-1])
    rejected_at = (mx.arange(T)[None, :] < depth[:, None])[..., None]
    F = mx.where(rejected_at, mx.concatenate([residual, P[:, -1:]], axis=1), P)
    at = kept[:, None, None]
    last, ids = mx.take_along_axis(F, at, axis=1)[:, 0], mx.take_along_axis(P_ids, at, axis=1)[:, 0]
    drawn = device_inverse_cdf(last, mx.take_along_axis(v, kept[:, None], axis=1)[:, 0])
    return kept, mx.take_along_axis(ids, drawn[:, None], axis=1)[:, 0]


class DeviceVerdicts:
    """A cycle's sampled rows judged on the device, so that the host reads only each one's drafts
    kept and next token: rows that draft from a sampler `judged_on_device`, without a grammar,
    whose drafts' q the device holds (drawn there, or a greedy draft sampler's point masses).
    Each draws 2 * depth + 1 uniforms from its own RNG at launch, kept or not (accept tests, then
    the residual or bonus draw): what it draws depends only on its own request."""

    def __init__(self, rows: list, lazy: tuple):
        self.rows, self.lazy = rows, lazy

    @classmethod
    def launch(cls, L, rows, row_depth: np.ndarray, proposal) -> Optional["DeviceVerdicts"]:
        import mlx.core as mx

        judged = [b for b, r in enumerate(rows) if row_depth[b] and r.grammar is None and judged_on_device(r.sampler)
                  and all(proposal.q_of(b, j) is None for j in range(int(row_depth[b])))]
        if not judged:
            return None
        W, T, V = L.shape
        idx = mx.array(judged)
        drafts = proposal.drafts[idx].astype(mx.int32)
        Q_ids, Q = _draft_qs(proposal, judged, drafts, V)
        cfgs = [rows[b].sampler for b in judged for _ in range(T)]
        exp = exp_nonpositive if mx.default_device() == mx.cpu else None     # MLX's exp is slow on the CPU
        P_ids, P = (a.reshape(len(judged), T, -1) for a in device_target_candidates(L[idx].reshape(-1, V), cfgs, exp))
        u, v = np.zeros((len(judged), T - 1), np.float32), np.zeros((len(judged), T), np.float32)
        for i, b in enumerate(judged):
            depth = int(row_depth[b])
            m = np.array([draft_uniform(rows[b].rng) for _ in range(2 * depth + 1)], dtype=np.float64)
            u[i, :depth], v[i, :depth + 1] = m[:depth] / (1 << UNIFORM_BITS), m[depth:] / (1 << UNIFORM_BITS)
        return cls(judged, device_verdicts(P_ids, P, Q_ids, Q, drafts, mx.array(u), mx.array(v),
                                           mx.array(row_depth[judged].astype(np.int32))))

    def read(self) -> dict:
        """After the verify's wait: b -> (drafts kept, next token)."""
        kept, token = (np.array(a) for a in self.lazy)
        return {b: (int(k), int(t)) for b, k, t in zip(self.rows, kept, token)}


def _draft_qs(proposal, judged: list, drafts, V: int) -> tuple:
    """The judged rows' drafts' q as candidates, ids and masses [N, depth, K]: a device draw's
    (`device_draft_masses`), else a point mass at the draft (ids past it pad with V)."""
    import mlx.core as mx

    idx, K = mx.array(judged), min(DRAFT_CANDIDATES, V)     # K: a device draw's candidates
    Q_ids, Q = [], []
    for j, (on_device, device_draw) in enumerate(proposal.device_draws):
        ids = mx.pad(drafts[:, j:j + 1], [(0, 0), (0, K - 1)], constant_values=V)
        q = mx.pad(mx.ones((len(judged), 1)), [(0, 0), (0, K - 1)])
        if device_draw is not None:
            drawn = mx.array(on_device[judged])[:, None]
            ids = mx.where(drawn, device_draw[0][idx].astype(mx.int32), ids)
            q = mx.where(drawn, device_draft_masses(device_draw[1][idx]), q)
        Q_ids.append(ids)
        Q.append(q)
    return mx.stack(Q_ids, axis=1), mx.stack(Q, axis=1)


def accept_chain(drafts: Sequence[int], judge: Callable[[int, int], tuple],
                 emit: Callable[[int, int], bool]) -> tuple[int, Optional[int]]:
    """Judge a row's chained drafts left to right: `judge(j, draft) -> (kept, token)` and
    `emit(j, token) -> finished` for each token the row takes. A kept draft is emitted and the
    next one judged; the first rejection emits the residual token and ends the chain; so does a
    row that finishes on an emitted token. Returns (drafts kept, the residual token or None)."""
    for j, draft in enumerate(drafts):
        kept, token = judge(j, int(draft))
        if not kept:
            emit(j, token)
            return j, token
        if emit(j, token):
            return j + 1, None
    return len(drafts), None
