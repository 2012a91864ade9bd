"""The MTP head's chained drafts from every start of a sequence at once: what training distils and
what an acceptance measurement reads, without running the head position by position.

Drafting at a start p runs the head on (h_p, token p+1) over its history (entries for positions
< p), then chains: draft k runs on the head's own output for draft k-1 and token p+k, attending
to that history and to its own chain's earlier entries only. `chained_drafts` computes draft k
for every p of a sequence in one forward per draft, teacher-forced (the chain's tokens are the
text's, as an accepted draft's are), through the head's own blocks: each block's attention gets a
`ChainCache` whose keys are the real history's followed by the chain's entries so far, and a mask
that lets start p see history positions <= p and its own chain's entries at the same p. Any block
whose attention follows mlx-lm's cache protocol (rope at `cache.offset`, `update_and_fetch`, the
mask passed through) runs unchanged: qwen3's and gemma3's do.
"""

from __future__ import annotations

import mlx.core as mx


class ChainCache:
    """One head layer's keys and values for a chained forward: level 0 (the drafts from the real
    history) stores its keys as the history; each later level returns the history's keys followed
    by every level's since (each [B, Hkv, T, D], one entry per start)."""

    def __init__(self):
        self.offset = 0           # level k's entries sit at positions p + k (RoPE)
        self.levels: list = []

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.levels.append((keys, values))
        if len(self.levels) == 1:
            return keys, values
        return (mx.concatenate([k for k, _ in self.levels], axis=2),
                mx.concatenate([v for _, v in self.levels], axis=2))


def chain_mask(T: int, level: int) -> mx.array:
    """[T, T * (level + 1)] boolean: start p sees history positions <= p and, in each later
    level's block of T, only its own entry p."""
    causal = mx.arange(T)[:, None] >= mx.arange(T)[None]
    own = mx.eye(T, dtype=mx.bool_)
    return mx.concatenate([causal] + [own] * level, axis=1)


def chained_drafts(head, hidden: mx.array, next_embeds: mx.array, depth: int) -> list:
    """The head's outputs [B, T, H] for each draft of a chain of `depth`, from every start p at
    once, as drafting runs them: draft 1 from the target's h_p and token p+1 (predicts token p+2);
    draft k from the head's own output for draft k-1 and token p+k (predicts token p+k+1).
    `hidden` [B, T, H] (the target's post-norm hidden states), `next_embeds` [B, T + depth - 1, H]
    (the embeddings of tokens 1 .. T + depth - 1)."""
    T = hidden.shape[1]
    caches = [ChainCache() for _ in head.layers]
    outs = []
    for k in range(depth):
        x = head.fc(mx.concatenate([head.pre_fc_norm_embedding(next_embeds[:, k:k + T]),
                                    head.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = "causal" if k == 0 else chain_mask(T, k)
        for layer, cache in zip(head.layers, caches):
            cache.offset = k
            x = layer(x, mask, cache)
        hidden = head.norm(x)
        outs.append(hidden)
    return outs
