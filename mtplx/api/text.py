"""A row's tokens as text: each token's exact bytes (for log-probabilities), incremental
detokenization that never splits a UTF-8 character, and stop-string matching on streamed text.
Plain Python over a transformers tokenizer; no MLX (the ingress imports this module)."""

from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence


def _byte_level_alphabet() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet (a printable character per byte), character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


def special_token_ids(tokenizer) -> FrozenSet[int]:
    """The tokenizer's special tokens: its named ones (EOS, padding...) and every added token
    marked special (a chat template's `<|im_start|>`, say), the ones `skip_special_tokens` drops."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


class TokenBytes:
    """A token's exact bytes and its text as logprobs report them. Byte-level BPE tokens map back to
    their raw bytes (a token holding part of a UTF-8 character has bytes and a U+FFFD text, as the
    tokenizer decodes it alone); special tokens are their own text, or nothing where the answer's
    text skips them (`shown`)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._special = special_token_ids(tokenizer)
        self._cache: Dict[int, tuple] = {}

    def shown(self, skip_special_tokens: bool) -> Callable[[int], tuple]:
        """(text, bytes) of a token as the answer's text has it: with `skip_special_tokens` a
        special token is ("", b""), so that the entries' texts join to the answer's text."""
        if not skip_special_tokens:
            return self
        return lambda token_id: ("", b"") if int(token_id) in self._special else self(token_id)

    def __call__(self, token_id: int) -> tuple:
        """(text, bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self._tok.convert_ids_to_tokens(int(token_id))
            if self._alphabet is not None and token_id not in self._special and piece is not None \
                    and all(ch in self._alphabet for ch in piece):
                raw = bytes(self._alphabet[ch] for ch in piece)
            else:
                raw = self._tok.decode([int(token_id)]).encode("utf-8")
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    `skip_special_tokens` (vLLM's field, its default true): special tokens the model emits
    mid-answer are left out of the text (they still count, and keep their log-probability entry
    with an empty text); false: they are text like any other. `spaces_between_special_tokens`
    (vLLM's, default true) would let a decoder put a space between two adjacent special tokens;
    the Rust ("fast") tokenizers this server loads never put one there, so its value changes no
    text here, as in vLLM's fast detokenizer. The token that ends a row (EOS or a requested stop
    token id) never reaches here: the replica does not stream it.

    Decodes a short sliding window (the tokens since the last clean boundary) rather than the whole
    sequence, so cost per step stays small; a window ending in U+FFFD (an incomplete byte sequence
    of a byte-level BPE) is held back until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self.ids: List[int] = []
        self._start = 0      # window start: a token boundary where decoding is clean
        self._read = 0       # tokens up to here have been turned into text
        self.text = ""

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, tokens: Iterable[int]) -> str:
        self.ids.extend(int(t) for t in tokens)
        if len(self.ids) == self._read:
            return ""
        prefix = self._decode(self.ids[self._start:self._read])
        full = self._decode(self.ids[self._start:])
        if (full.endswith("\ufffd") or len(full) <= len(prefix)) and len(self.ids) - self._read < 8:
            # An incomplete UTF-8 character at the end: wait for the token that completes it.
            # (Genuinely invalid bytes are let through as U+FFFD after 8 tokens.)
            return ""
        delta = full[len(prefix):]
        self._start, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end decodes as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._start:self._read])
        full = self._decode(self.ids[self._start:])
        delta = full[len(prefix):] if full.startswith(prefix) else full
        self._start = self._read = len(self.ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Matches stop strings on streamed text. Text that could be the start of a stop string is held
    back; on a match the text is cut before the stop string (after it with `include_stop`, vLLM's
    `include_stop_str_in_output`), `stopped` becomes True and `matched` is the stop string that
    matched (the earliest in the text)."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = bool(include_stop)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: Optional[str] = None

    def push(self, delta: str, armed: bool = True) -> str:
        """`delta`'s text that can be returned now. Unarmed (a `min_tokens` row before its minimum)
        nothing matches, but a held tail can still begin a stop string that ends once armed."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        text = self._buf + delta
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0] if armed else []
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._buf = ""
            return text[:at + (len(self.matched) if self.include_stop else 0)]
        keep = 0
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        self._buf = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class StopStringWatch:
    """A row's stop strings watched where it decodes (the engine's `StopWatch`): each emitted
    token is detokenized as the client's text will be (`skip_special_tokens`) and matched as the
    ingress's `StopStringMatcher` matches it, so the row ends in the step whose token completed a
    stop string and the ingress cuts its text at the same token. Before `min_tokens` tokens
    nothing matches."""

    def __init__(self, tokenizer, stops: Sequence[str], skip_special_tokens: bool = True, min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._matcher = StopStringMatcher(stops)
        self._min_tokens = int(min_tokens)
        self._n = 0

    def push(self, token: int) -> Optional[str]:
        """The stop string the text completed at `token` (None: none yet)."""
        self._n += 1
        self._matcher.push(self._detok.push([token]), armed=self._n >= self._min_tokens)
        return self._matcher.matched


def tokens_through(tokenizer, ids: Sequence[int], marker: str) -> int:
    """How many of `ids` it takes for their text to contain `marker` (all of them when it never
    does): a thinking section's tokens, `</think>` included."""
    def holds(k: int) -> bool:
        return marker in tokenizer.decode(list(ids[:k]), skip_special_tokens=False)

    if not holds(len(ids)):
        return len(ids)
    low, high = 1, len(ids)          # the least k that holds is in [low, high]
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return low
