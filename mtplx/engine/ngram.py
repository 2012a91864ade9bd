"""Drafts from a row's own context (prompt lookup, vLLM's n-gram proposer): where the tokens a
row just wrote occurred before in its prompt or output, the tokens that followed them then are
the draft. A row's `NgramIndex` keeps, for every n-gram of up to NGRAM_MAX tokens, where it last
occurred with a token after it, updated as the row emits; a lookup is a few dict reads.

Why beside the MTP head: a small head predicts the next-but-one token from the target's hidden
state and the next token, and does not learn to copy. Gemma 3 270M's greedy text on bench load's
code prompts repeats names, lines and whole blocks; there the head keeps 0.40 of its first drafts
and the lookup (falling back to the head) 0.73 (BENCHMARKS.md, "Drafts from the row's context").

Exactness does not depend on where a draft came from: the verify judges every draft against the
target. Only greedy rows take context drafts: a sampled row's draws would depend on them."""

from __future__ import annotations

from typing import Iterable, Optional

NGRAM_MAX = 3        # the longest n-gram matched: the longest match wins, down to one token


class NgramIndex:
    """A row's tokens and, per n-gram of 1..NGRAM_MAX tokens, the position of the token that
    followed its latest occurrence."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list = []
        self.after: list = [{} for _ in range(NGRAM_MAX + 1)]     # [n] n-gram -> position after it
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks, i = self.tokens, len(self.tokens)
        for n in range(1, min(NGRAM_MAX, i) + 1):
            self.after[n][tuple(toks[i - n:i])] = i
        toks.append(int(token))

    def propose(self, k: int, next_token: Optional[int] = None) -> list:
        """Up to `k` drafts continuing the tokens (and `next_token`, written but not yet in the
        index): what followed the latest earlier occurrence of their longest matching suffix,
        copied on through the drafts themselves where the match is recent (a repeating period
        shorter than k); [] where no suffix occurred before."""
        toks = self.tokens
        tail = toks[-NGRAM_MAX:] + ([] if next_token is None else [int(next_token)])
        end = len(toks) + (next_token is not None)
        for n in range(min(NGRAM_MAX, end - 1), 0, -1):
            at = self.after[n].get(tuple(tail[len(tail) - n:]))
            if at is not None:
                out: list = []
                while len(out) < k:
                    j = at + len(out)
                    out.append(toks[j] if j < len(toks) else tail[-1] if j < end else out[j - end])
                return out
        return []
