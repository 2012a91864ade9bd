"""The literal-repetition stop: which tails qualify, and how much is trimmed."""

import pytest

from mtplx.engine.repetition import RepetitionLimits, repeated_tail

SMALL = RepetitionLimits(min_tokens=20, min_repeated=12, min_repeats=4, max_block=8)


def test_shortest_qualifying_block_and_all_its_copies():
    head = list(range(100, 110))
    hit = repeated_tail(head + [1, 2, 3] * 6, SMALL)
    assert (hit.block_tokens, hit.repeats, hit.raw_tokens, hit.trimmed_tokens) == (3, 6, 28, 15)
    assert repeated_tail(head + [7] * 12, SMALL).block_tokens == 1
    # a partial copy at the very end is not a repetition of the block
    assert repeated_tail(head + [1, 2, 3] * 6 + [1], SMALL).block_tokens == 3   # period 3 still ends it
    assert repeated_tail(head + [1, 2, 3] * 6 + [9], SMALL) is None


@pytest.mark.parametrize("tokens", [
    list(range(100, 110)) + [1, 2, 3] * 3,          # 3 copies < min_repeats
    list(range(100, 102)) + [5] * 12,               # repeats enough, but the row is shorter than min_tokens
    list(range(100, 111)) + [1, 2] * 5,             # 5 copies cover 10 < min_repeated
    list(range(60)) + list(range(9)) * 4,           # block longer than max_block
])
def test_tails_that_do_not_qualify(tokens):
    assert repeated_tail(tokens, SMALL) is None
