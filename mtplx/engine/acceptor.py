"""The acceptor: which of a row's drafts the target keeps. Greedy rows keep a draft equal to the
target's argmax; sampled rows keep it with probability min(1, p/q) and at the first rejection
draw from the residual max(p - q, 0), so every kept token follows the target distribution p
(speculative sampling; Leviathan et al., Chen et al.). Drafts are judged left to right; the
first rejection ends the chain."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from mtplx.sampling import Distribution, inverse_cdf, sample, to_host


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
    in a lane whose rows are all greedy, the argmax ids [W, T] (read on the device); otherwise
    the logits on the host [W, T, V], from which each row takes its own distribution (a greedy
    row's is a point mass at the argmax) with its own RNG."""

    def __init__(self, vocab: int, ids: Optional[np.ndarray] = None, logits: Optional[np.ndarray] = None,
                 allowed: Optional[dict] = None, device_logits=None):
        self.vocab, self.ids, self.logits = vocab, ids, logits
        self.allowed = allowed or {}      # sampled constrained rows: b -> [its grammar's mask at each position]
        self.device_logits = device_logits   # the verify's logits, read row by row where a grammar needs them

    def _host_logits(self, b: int, j: int):
        """Row b's logits at position j on the host, when a grammar asks (all rows' come at once)."""
        def read():
            if self.logits is None:
                self.logits = to_host(self.device_logits)
            return self.logits[b, j]
        return read

    def p(self, row, b: int, j: int):
        """Row b's target distribution at position j, restricted to what its grammar allows there
        (a greedy constrained row's grammar is at position j's state when it is judged)."""
        if row.grammar is not None and row.greedy:
            return Distribution.point(row.constrained_argmax(int(np.argmax(self.logits[b, j])),
                                                             self._host_logits(b, j)), self.vocab)
        masks = self.allowed.get(b)
        return row.dist(self.logits[b, j], allowed=None if masks is None else masks[j])

    def token(self, row, b: int, j: int) -> int:
        """The target's own token at position j: row b's next token when it keeps no further draft."""
        if self.ids is not None:
            token = int(self.ids[b, j])
            return token if row.grammar is None else row.constrained_argmax(token, self._host_logits(b, j))
        return sample(self.p(row, b, j), row.rng)

    def judge(self, row, b: int, j: int, draft: int, q: Optional[Distribution]) -> tuple[bool, int]:
        """(kept, token): the draft at position j kept, or the token the row takes instead. `q`: the
        draft's distribution (None: a point mass, the head's argmax)."""
        if self.ids is not None:
            target = self.token(row, b, j)
            return draft == target, target
        q = q if q is not None else Distribution.point(draft, self.vocab)
        return verify_one_token(self.p(row, b, j), q, draft, row.rng)


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
