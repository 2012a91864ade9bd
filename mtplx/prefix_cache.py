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

from .models.cache import restore_layer, snapshot_layer, snapshot_nbytes


@dataclass(frozen=True)
class PrefixState:
    key: tuple                 # prompt[:m + 1]
    target_layers: tuple       # per target layer, a snapshot (see models.cache.snapshot_layer)
    mtp_layers: tuple          # per MTP layer

    @property
    def cached_tokens(self) -> int:
        return len(self.key) - 1

    @property
    def nbytes(self) -> int:
        return sum(snapshot_nbytes(s) for s in self.target_layers + self.mtp_layers)


def snapshot(prompt: list, m: int, cache: list, mtp_cache: list) -> PrefixState:
    return PrefixState(tuple(prompt[:m + 1]), tuple(snapshot_layer(c, m) for c in cache),
                       tuple(snapshot_layer(c, m) for c in mtp_cache))


def restore(state: PrefixState) -> tuple[list, list]:
    """Fresh per-row caches holding the state (the snapshot itself stays immutable)."""
    return [restore_layer(s) for s in state.target_layers], [restore_layer(s) for s in state.mtp_layers]
