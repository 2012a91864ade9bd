"""The literal-repetition stop (as MTPLX's): a row that arms it stops when its output ends in one
block of tokens repeated back to back, and the repeats after the first copy are trimmed.

It fires once the row has at least `min_tokens` tokens, for the shortest block (1..`max_block`
tokens) whose consecutive copies at the end number at least `min_repeats` and cover at least
`min_repeated` tokens. MTPLX's defaults: 768, 192, 4, 96 (where a program starts,
`MTPLX_REPETITION_STOP_MIN_TOKENS`, `..._MIN_REPEATED`, `..._MIN_REPEATS`, `..._MAX_BLOCK` override
them: `mtplx.engine.settings`). A lane checks once per cycle,
so the stop may come up to two tokens after the repetition qualifies; the trim is a suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class RepetitionLimits:
    min_tokens: int = 768
    min_repeated: int = 192
    min_repeats: int = 4
    max_block: int = 96


@dataclass(frozen=True)
class RepetitionStop:
    block_tokens: int
    repeats: int            # consecutive copies of the block ending the output
    raw_tokens: int         # output length before the trim

    @property
    def trimmed_tokens(self) -> int:
        return (self.repeats - 1) * self.block_tokens

    def stats(self) -> dict:
        return {"repetition_stop_triggered": True, "repetition_stop_reason": "literal_repetition",
                "repetition_stop_block_tokens": self.block_tokens, "repetition_stop_repeats": self.repeats,
                "repetition_stop_trimmed_tokens": self.trimmed_tokens, "repetition_stop_raw_tokens": self.raw_tokens}


def repeated_tail(tokens: Sequence[int], limits: RepetitionLimits = RepetitionLimits()) -> Optional[RepetitionStop]:
    """The repetition that ends `tokens`, if it qualifies (see the module doc); else None."""
    n = len(tokens)
    if n < limits.min_tokens:
        return None
    arr = np.asarray(tokens)
    for b in range(1, min(limits.max_block, n // limits.min_repeats) + 1):
        need = max(limits.min_repeats, -(-limits.min_repeated // b)) * b
        if need > n or not np.array_equal(arr[n - need:n - b], arr[n - need + b:]):
            continue
        # count every consecutive copy: arr[i] == arr[i + b] holds back to where the run starts
        same = arr[:n - b] == arr[b:]
        breaks = np.flatnonzero(~same)
        start = breaks[-1] + 1 if breaks.size else 0       # first index of the periodic run
        return RepetitionStop(b, (n - start) // b, n)
    return None
