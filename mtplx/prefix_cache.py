"""Prompt-prefix state: what a prefill leaves behind at a chunk boundary, reusable by a later
prompt that starts with the same tokens.

Prefill splits the prompt body at absolute multiples of the chunk size, so a restore at a
boundary m continues with exactly the partition a cold prefill would use: greedy output with
reuse is bit-for-bit the output without it. At boundary m the target holds KV for positions
[0, m) and the MTP head holds history entries (h_i, token_{i+1}) for i < m, which reads token m;
so an entry is keyed by the first m + 1 prompt tokens and saves m tokens of prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache


@dataclass(frozen=True)
class PrefixState:
    key: tuple                 # prompt[:m + 1]
    target_kv: tuple           # per layer (keys, values), each [1, H, m, D]
    mtp_kv: tuple              # per MTP layer (keys, values), each [1, H, m, D]

    @property
    def cached_tokens(self) -> int:
        return len(self.key) - 1

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.target_kv + self.mtp_kv)


def _snapshot(cache: list, m: int) -> tuple:
    out = tuple((mx.array(c.keys[..., :m, :]), mx.array(c.values[..., :m, :])) for c in cache)
    mx.eval(out)
    return out


def snapshot(prompt: list, m: int, cache: list, mtp_cache: list) -> PrefixState:
    return PrefixState(tuple(prompt[:m + 1]), _snapshot(cache, m), _snapshot(mtp_cache, m))


def _restore(kv: tuple) -> list:
    caches = []
    for k, v in kv:
        c = KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
    return caches


def restore(state: PrefixState) -> tuple[list, list]:
    """Fresh per-row caches holding the state (the snapshot itself stays immutable)."""
    return _restore(state.target_kv), _restore(state.mtp_kv)
