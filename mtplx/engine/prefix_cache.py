"""Prompt-prefix state: what a prefill leaves behind, reusable by a later prompt.

Two kinds of state, both bit for bit what a cold prefill computes:
- at a chunk boundary m: prefill splits the prompt body at absolute multiples of the chunk size,
  so a restore at a boundary continues with exactly the partition a cold prefill would use. At
  boundary m the target holds KV for positions [0, m) and the MTP head holds history entries
  (h_i, token_{i+1}) for i < m, which reads token m; so it is keyed by the first m + 1 prompt
  tokens and saves m tokens of prefill;
- of a whole prompt: the caches where its prefill ended, with the prefill's output (last logits
  and hidden). It is keyed by the whole prompt and serves only that exact prompt (a longer prompt
  would continue off the chunk partition), which then needs no prefill at all: repeated prompts,
  retries, the same question sent by many clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mtplx.models.cache import restore_layer, snapshot_layer, snapshot_nbytes


@dataclass(frozen=True)
class PrefixState:
    key: tuple                 # prompt[:m + 1] at a boundary; the whole prompt when `out` is set
    target_layers: tuple       # per target layer, a snapshot (see models.cache.snapshot_layer)
    mtp_layers: tuple          # per MTP layer
    out: Optional[tuple] = None   # a whole prompt's state: its prefill's (logits_last, hidden_last)

    @property
    def whole(self) -> bool:
        return self.out is not None

    @property
    def cached_tokens(self) -> int:
        return len(self.key) if self.whole else len(self.key) - 1

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in self.out) if self.whole else 0
        return extra + sum(snapshot_nbytes(s) for s in self.target_layers + self.mtp_layers)


def snapshot(prompt: list, m: int, cache: list, mtp_cache: list) -> PrefixState:
    return PrefixState(tuple(prompt[:m + 1]), tuple(snapshot_layer(c, m) for c in cache),
                       tuple(snapshot_layer(c, m) for c in mtp_cache or ()))


def snapshot_whole(prompt: list, cache: list, mtp_cache: list, out: tuple) -> PrefixState:
    """The state a whole prompt's prefill ended in: each layer at its own length (the MTP head's
    history is one entry short of the target's KV: the last entry waits for the first token)."""
    def layer(c):
        return snapshot_layer(c, c.offset if isinstance(getattr(c, "offset", None), int) else len(prompt))

    kept = tuple(mx.array(a) for a in out)     # copies: the hidden is a view of the last chunk's
    mx.eval(kept)
    return PrefixState(tuple(prompt), tuple(layer(c) for c in cache), tuple(layer(c) for c in mtp_cache or ()),
                       kept)


def restore(state: PrefixState) -> tuple[list, Optional[list]]:
    """Fresh per-row caches holding the state (the snapshot itself stays immutable); the head's
    None when the state has none (a model without a head: its prefill primes no history)."""
    mtp = [restore_layer(s) for s in state.mtp_layers] if state.mtp_layers else None
    return [restore_layer(s) for s in state.target_layers], mtp
