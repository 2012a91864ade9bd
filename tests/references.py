"""Plain greedy AR references (`generate_ar`, the exactness oracle), computed once per model and
prompt for the whole test session: greedy decoding of n tokens is the first n tokens of any longer
run, so one run serves every shorter budget."""

import numpy as np

from mtplx.engine.decode import generate_ar
from mtplx.sampling import GREEDY


def greedy_ar(model, prompt_ids, max_tokens: int) -> list:
    """The first max_tokens tokens of plain greedy AR from prompt_ids (no stop tokens)."""
    runs = model.__dict__.setdefault("_greedy_ar_references", {})
    key = tuple(int(t) for t in prompt_ids)
    if len(runs.get(key, ())) < max_tokens:
        runs[key] = generate_ar(model, list(key), max_tokens, GREEDY).tokens
    return list(runs[key][:max_tokens])


def stop_string_in(tokenizer, tokens, after: int) -> tuple:
    """(s, n): a stop string whose text first completes at token n > `after` of `tokens`."""
    for n in range(after + 1, len(tokens) + 1):
        text, before = (tokenizer.decode(list(tokens[:m]), skip_special_tokens=True) for m in (n, n - 1))
        s = text[-3:]
        if s.strip() and s not in before:
            return s, n
    raise AssertionError("no stop string completes in these tokens")


# A float32 near-tie: the oracle's top two logits closer than this share of the logits' scale
TIE_RELATIVE = 1e-4


def assert_greedy_matches(model, oracle_lm, prompt_ids, expected: list, got: list, depth: int = 3) -> None:
    """Our greedy tokens `got` equal the oracle's `expected`, or they part at a proven float32 tie
    (the exactness contract: a flipped tie is proved, never passed silently). Proven means: at the
    first differing position the oracle ranks our token second, within TIE_RELATIVE of its first,
    and our own target, fed the same tokens, picks the oracle's token in a one-token forward and
    ours when the position is computed inside a verify-shaped block (2 to 1 + depth positions):
    the flip comes from the shape of the products alone. Past a proven tie the texts differ
    legitimately, so nothing after it is compared."""
    import mlx.core as mx

    at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if at is None:
        assert len(got) == len(expected), f"{len(got)} tokens where the oracle has {len(expected)}"
        return
    seq = [int(t) for t in prompt_ids] + list(expected)
    n = len(prompt_ids) + at            # the tokens before the differing one
    logits = oracle_lm(mx.array([seq[:n]]))[0, -1].astype(mx.float32)
    row = np.array(logits)
    runner_up = int(np.argsort(-row, kind="stable")[1])
    margin, scale = float(row[expected[at]] - row[got[at]]), float(np.abs(row).max())
    where = f"position {at}: the oracle's {expected[at]} (logit {row[expected[at]]:.7g}), ours {got[at]} " \
            f"(logit {row[got[at]]:.7g}), margin {margin:.3g} of scale {scale:.3g}"
    assert runner_up == got[at] and margin <= TIE_RELATIVE * scale, f"not a near-tie: {where}"
    ours = {(T, j): _block_argmax(model, seq, n, T, j) for T in range(1, depth + 2) for j in range(T)
            if n - 1 - j >= 1 and n - 1 - j + T <= len(seq)}
    assert ours.get((1, 0)) == expected[at] and got[at] in ours.values(), \
        f"a near-tie our own forward does not flip by its shape ({ours}): {where}"


def _block_argmax(model, seq: list, n: int, T: int, j: int) -> int:
    """Our target's argmax for the token after seq[:n], computed at offset j of a block of T
    tokens fed together over a cache of the tokens before it."""
    import mlx.core as mx

    start = n - 1 - j
    cache = model.make_cache()
    model.hidden(mx.array([seq[:start]]), cache)
    h = model.hidden(mx.array([seq[start:start + T]]), cache)
    return int(mx.argmax(model.logits(h)[0, j]).item())
