"""How a replica's prefix cache and the router name a prompt prefix: chained hashes of fixed-size
token blocks, in the style of vLLM's block hashes, seeded with the cache partition.

A replica banks a prompt's state at absolute multiples of its prefill chunk (`block` here) and
at the whole prompt's end (`mtplx.engine.prefix_cache`); it announces each banked and each
evicted state by its name (`state_hash`), and the router finds, for a new prompt, the longest
prefix a replica holds by naming the prompt's own blocks the same way (`prompt_hashes`). The
partition (`salt`: a digest of the caller's key and the request's cache salt) seeds the chain,
so that the same tokens in two partitions have different names, as they are different entries
in the bank. Plain Python: the ingress computes these without MLX.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import List, Optional, Sequence, Tuple


def _digest(*parts: bytes) -> bytes:
    h = blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.digest()


def _tokens(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def _chain(tokens: Sequence[int], block: int, salt: Optional[str]) -> List[bytes]:
    """The chain's digests: [h_0 (the partition), h_1 (tokens[:block]), ..., h_k] over the full blocks."""
    out = [_digest(b"mtplx-prefix/", (salt or "").encode())]
    for j in range(len(tokens) // block):
        out.append(_digest(out[-1], _tokens(tokens[j * block:(j + 1) * block])))
    return out


def _whole(chain: List[bytes], tokens: Sequence[int], block: int) -> int:
    return int.from_bytes(_digest(chain[-1], b"/whole/", _tokens(tokens[(len(chain) - 1) * block:])), "big")


def prompt_hashes(tokens: Sequence[int], block: int, salt: Optional[str]) -> Tuple[List[int], int]:
    """(the names of `tokens[:j * block]` for j = 1, 2, ... over its full blocks, the name of the
    whole of `tokens`), in partition `salt`."""
    chain = _chain(tokens, block, salt)
    return [int.from_bytes(h, "big") for h in chain[1:]], _whole(chain, tokens, block)


def state_hash(key: Sequence[int], whole: bool, block: int, salt: Optional[str]) -> Optional[int]:
    """The name of a banked prefix state: a whole prompt's (`whole`, `key` the prompt), or a
    chunk boundary's (`key` = the prompt's first m + 1 tokens, m a multiple of `block`: the state
    holds m of them). None for a key that is neither."""
    if whole:
        return _whole(_chain(key, block, salt), key, block)
    m = len(key) - 1
    if m <= 0 or m % block:
        return None
    return int.from_bytes(_chain(key[:m], block, salt)[-1], "big")


def held_prefix(n_tokens: int, block: int, names: Tuple[List[int], int], held) -> int:
    """How many leading tokens of a prompt of `n_tokens` tokens (`names`: its `prompt_hashes`) a
    replica holding the states named in `held` (a container of names) skips: all of them for
    its whole-prompt state, else its longest block prefix; 0: none."""
    blocks, whole = names
    if whole in held:
        return n_tokens
    for j in range(len(blocks), 0, -1):
        if blocks[j - 1] in held:
            return j * block
    return 0
