"""Plain greedy AR references (`generate_ar`, the exactness oracle), computed once per model and
prompt for the whole test session: greedy decoding of n tokens is the first n tokens of any longer
run, so one run serves every shorter budget."""

from mtplx.engine.decode import generate_ar
from mtplx.sampling import GREEDY


def greedy_ar(model, prompt_ids, max_tokens: int) -> list:
    """The first max_tokens tokens of plain greedy AR from prompt_ids (no stop tokens)."""
    runs = model.__dict__.setdefault("_greedy_ar_references", {})
    key = tuple(int(t) for t in prompt_ids)
    if len(runs.get(key, ())) < max_tokens:
        runs[key] = generate_ar(model, list(key), max_tokens, GREEDY).tokens
    return list(runs[key][:max_tokens])
