"""Structured output: what a row's constraint is (`Constraint`, built and checked at the ingress,
carried to the replica unchanged) and how a lane row enforces it (`RowGrammar`). The grammar
work is llguidance's: it compiles JSON schemas, regular expressions and Lark grammars, and its
matcher consumes tokens and rolls them back, which speculation needs. No MLX here.

A constraint may start after a thinking section: the grammar applies once the row's text has
produced `think_end` (the chat template's end-of-thinking marker); before that the row is free,
except that past `think_budget` thinking tokens the marker is forced, token by token. A
constraint without a grammar is a thinking budget alone.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

# A grammar that has not compiled within these bounds is refused (400), never left to hang a lane.
MAX_GRAMMAR_CHARS = 256 * 1024
# llguidance's parser limits, from what this workload measured it needs (`python -m
# benchmarks.grammar_fuel`: every schema of benchmarks/schemas.py as a JSON schema and as a forced
# tool call, its valid example walked, each mask computed). Lexer fuel is llguidance's unit of
# lexer work (~14k a millisecond per mask): a mask takes at most STEP_LEXER_FUEL of the model
# owner's time, which every row of the lane waits on. Measured need per mask: 9,280 at the shipped
# 4k vocabulary, 11,584 at 16k, 14,592 at 56k (it grows slowly with the vocabulary: ~18k by that
# trend at 262k); at start 2,512 (it grows with the schema, not the vocabulary). So llguidance's
# own defaults, 13x the largest measured need per mask (this server ran 10x them before).
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000
# A grammar's lexer memory: the lexer builds its states as text meets them, and a grammar's
# states are shared by every row decoding under it (a row's matcher is a copy of its grammar's
# template). Measured: at most 346 states on the workload, 41k (18 MB, ~0.45 kB a state) for a
# 6,000-character free string of `maxLength` 6000; llguidance's default allows 250k, its docs
# say 1-2 kB a state. A grammar reaching the limit puts its row's matcher in an error state.
MAX_LEXER_STATES = 100_000
LEXER_STATE_BYTES = 2048       # llguidance's upper estimate a state: the bound the snapshot reports

# JSON Schema keywords llguidance does not enforce: refused by name and place, never ignored.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
                        "minContains", "maxContains", "uniqueItems", "propertyNames", "unevaluatedProperties",
                        "unevaluatedItems")


class GrammarError(RuntimeError):
    """A row's grammar entered llguidance's error state while the row decoded (a token it did not
    allow reached it, or the parser ran out of its limits): the row fails, alone."""


class ConstraintError(ValueError):
    """A constraint that cannot be enforced: `message` says what to fix, `where` names the place
    (a JSON pointer into the schema, or the request field)."""

    def __init__(self, message: str, where: Optional[str] = None):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class Constraint:
    """A row's constraint. `grammar`: an llguidance grammar (from the builders below; None: no
    grammar). `kind` names it for stats and errors ("json_schema", "json_object", "regex",
    "grammar", "choice", "tool_call", "thinking", "min_tokens"). `think_end`: the grammar starts
    after this text; `think_budget`: thinking tokens before `think_end` is forced. `hold_ids`
    are not allowed among the row's first `hold_until` tokens (vLLM's `min_tokens`: the row's
    stop tokens, held back as if the model never gave them weight)."""

    grammar: Optional[str] = None
    kind: str = "grammar"
    think_end: Optional[str] = None
    think_budget: Optional[int] = None
    hold_ids: frozenset = frozenset()
    hold_until: int = 0

    def __post_init__(self):
        if self.grammar is None and self.think_budget is None and not self.holds:
            raise ValueError("a Constraint needs a grammar, a thinking budget or tokens to hold back")
        if self.think_budget is not None and (self.think_end is None or self.think_budget < 0):
            raise ValueError("think_budget needs think_end and must be >= 0")

    @property
    def reads_text(self) -> bool:
        """Enforcing it reads the tokens' text (a grammar, a thinking marker): it needs
        llguidance's tokenizer. Holding tokens back needs only their ids."""
        return self.grammar is not None or self.think_end is not None

    @property
    def holds(self) -> bool:
        return self.hold_until > 0 and bool(self.hold_ids)

    def with_thinking(self, think_end: Optional[str], think_budget: Optional[int] = None) -> "Constraint":
        return replace(self, think_end=think_end, think_budget=think_budget)


def holding_back(constraint: Optional[Constraint], stop_ids, min_tokens: int) -> Optional[Constraint]:
    """`constraint` with the row's stop tokens `stop_ids` held back for its first `min_tokens`
    tokens (a constraint of its own when the row has none). A grammar's end still ends the row."""
    stop_ids = frozenset(int(t) for t in stop_ids)
    if min_tokens <= 0 or not stop_ids:
        return constraint
    if constraint is None:
        return Constraint(kind="min_tokens", hold_ids=stop_ids, hold_until=int(min_tokens))
    return replace(constraint, hold_ids=stop_ids, hold_until=int(min_tokens))


# -- building grammars ------------------------------------------------------------------------------

def _llg():
    import llguidance

    return llguidance


def json_schema_grammar(schema) -> str:
    """The grammar of JSON values matching `schema` (a dict, or its JSON text). Compact output,
    no free whitespace: a model cannot wander into a run of spaces."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ConstraintError("the JSON schema nests too deeply to be read") from None
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be an object (or true), not {json.dumps(schema)[:40]}")
    try:
        bad = _unsupported_keyword(schema, "")
    except RecursionError:
        raise ConstraintError("the JSON schema nests too deeply to be read") from None
    if bad is not None:
        keyword, where = bad
        raise ConstraintError(f"JSON Schema keyword {keyword!r} at {where or '/'} cannot be enforced by this "
                              f"server's grammar engine; remove it", where or "/")
    return _llg().LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `json_object`)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return _llg().LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(text)


def choice_grammar(choices) -> str:
    """Exactly one of `choices` (strings)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError("choice needs a non-empty list of strings")
    return lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices))


def _unsupported_keyword(schema, where: str) -> Optional[tuple]:
    """(keyword, JSON pointer) of the first keyword llguidance cannot enforce, walking every
    subschema; None when there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            hit = _unsupported_keyword(item, f"{where}/{i}")
            if hit:
                return hit
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            return key, f"{where}/{key}"
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            for name, sub in (value.items() if isinstance(value, dict) else ()):
                hit = _unsupported_keyword(sub, f"{where}/{key}/{_pointer_part(name)}")
                if hit:
                    return hit
        elif isinstance(value, (dict, list)):
            hit = _unsupported_keyword(value, f"{where}/{key}")
            if hit:
                return hit
    return None


def _pointer_part(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


# -- checking a constraint against a tokenizer ----------------------------------------------------

def grammar_tokenizer(hf_tokenizer, vocab_size: Optional[int] = None):
    """llguidance's view of a Hugging Face fast tokenizer (about a second to build: cached on the
    tokenizer object). `vocab_size`: the model's, when its embedding is wider than the tokenizer."""
    cache = getattr(hf_tokenizer, "_mtplx_grammar_tokenizers", None)
    if cache is None:
        cache = {}
        try:
            hf_tokenizer._mtplx_grammar_tokenizers = cache
        except AttributeError:
            pass
    if vocab_size not in cache:
        from llguidance.hf import from_tokenizer

        base = from_tokenizer(hf_tokenizer)
        cache[vocab_size] = base if vocab_size is None or vocab_size <= base.vocab_size else \
            from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    return cache[vocab_size]


def parser_limits():
    return _llg().LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                 max_lexer_states=MAX_LEXER_STATES)


def check_constraint(constraint: Constraint, tokenizer, where: Optional[str] = None, schema=None) -> None:
    """Raise `ConstraintError` when the constraint's grammar does not compile for `tokenizer` (an
    llguidance tokenizer) within the bounds: the message is llguidance's, with the place in
    `schema` (the JSON schema it came from, if any) of the keyword or value it names."""
    if constraint.grammar is None:
        return
    if len(constraint.grammar) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the grammar is {len(constraint.grammar)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS} are allowed", where)
    message = _grammar_error(tokenizer, constraint.grammar)
    if message is not None:
        place = _place(schema, message) if schema is not None else None
        if place is not None:
            message, where = f"{message} (at {place or '/'})", (f"{where}:" if where else "") + (place or "/")
        raise ConstraintError(f"{constraint.kind} cannot be enforced: {message}", where)


# Clients send the same schemas again and again: a grammar is compiled once per tokenizer (a check
# and a matcher take about a millisecond each), and each row's matcher is a copy of its template.
GRAMMAR_CACHE = 256


@functools.lru_cache(maxsize=GRAMMAR_CACHE)
def _grammar_error(tokenizer, grammar: str) -> Optional[str]:
    """Why `grammar` does not compile for `tokenizer` within the bounds (None: it does)."""
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits())
    if is_error:
        return _first_line(messages[0] if messages else "the grammar does not compile")
    matcher = _template_matcher(tokenizer, grammar)
    return _first_line(matcher.get_error()) if matcher.is_error() else None


@functools.lru_cache(maxsize=GRAMMAR_CACHE)
def _template_matcher(tokenizer, grammar: str):
    return _llg().LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())


def _place(schema, message: str) -> Optional[str]:
    """The JSON pointer of what an llguidance message names: an unknown type or format, an
    unimplemented keyword, a missing reference."""
    for pattern, key in ((r"Invalid type: (\S+)", "type"), (r"Unknown format: (\S+)", "format"),
                         (r'Unimplemented keys: \["([^"]+)"', None), (r"Pointer '([^']*)' does not exist", "$ref")):
        m = re.search(pattern, message)
        if m is None:
            continue
        value = m.group(1)
        if key == "$ref":
            value = "#" + value
        return _find(schema, "", key or value, None if key is None else value)
    return None


def _find(node, where: str, key: str, value) -> Optional[str]:
    if isinstance(node, dict):
        if key in node and (value is None or node[key] == value
                            or (isinstance(node[key], list) and value in node[key])):
            return f"{where}/{_pointer_part(key)}"
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for name, sub in items:
        hit = _find(sub, f"{where}/{_pointer_part(name)}", key, value)
        if hit is not None:
            return hit
    return None


def _first_line(message: str) -> str:
    """llguidance's message without its source excerpt: the first line, and for a regex error
    the line that says what is wrong ("error: unclosed character class")."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return message
    if re.search(r"regex parse error:?\s*$", lines[0]):
        detail = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("error:")), None)
        if detail:
            return f"{lines[0].strip()} {detail[len('error:'):].strip()}"
    return lines[0]


# -- a row's grammar while it decodes ---------------------------------------------------------------

class GrammarMemory:
    """What the live rows' grammars hold, counted as they change: each row's masks (a bool a
    vocabulary token, kept for the positions it has speculated past) and its bitmask buffer, in
    bytes; and the bounds of what llguidance holds (its lexer states, per compiled grammar, shared
    by that grammar's rows). The replica's snapshot reports `stats()` (its `grammar` section)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.rows = 0
        self.row_bytes = 0
        self.peak_row_bytes = 0          # the most one row has held
        self.rows_started = 0

    def add_row(self) -> None:
        with self._lock:
            self.rows += 1
            self.rows_started += 1

    def update(self, before: int, now: int) -> None:
        with self._lock:
            self.row_bytes += now - before
            self.peak_row_bytes = max(self.peak_row_bytes, now)

    def end_row(self, held: int) -> None:
        with self._lock:
            self.rows -= 1
            self.row_bytes -= held

    def stats(self) -> dict:
        grammars = _template_matcher.cache_info().currsize
        return {"live_rows": self.rows, "rows_started": self.rows_started, "row_bytes": self.row_bytes,
                "peak_row_bytes": self.peak_row_bytes, "compiled_grammars": grammars,
                "max_lexer_states": MAX_LEXER_STATES,
                "lexer_bytes_bound_per_grammar": MAX_LEXER_STATES * LEXER_STATE_BYTES,
                "step_lexer_fuel": STEP_LEXER_FUEL, "initial_lexer_fuel": INITIAL_LEXER_FUEL}


GRAMMAR_MEMORY = GrammarMemory()


class _Held:
    """A row grammar's counted bytes, kept apart from the row so that its end (the row dropped)
    can give them back (`weakref.finalize`)."""

    __slots__ = ("bytes",)

    def __init__(self):
        self.bytes = 0



@functools.lru_cache(maxsize=GRAMMAR_CACHE)      # few markers, few prefixes begun
def _marker_mask(tokenizer, end: bytes, vocab: int, started: tuple) -> np.ndarray:
    """Tokens allowed while thinking before a grammar: none that holds the marker `end` with bytes
    after it, and, where the text so far ends with the marker's first k bytes (k in `started`),
    none that completes it with bytes after it."""
    mask = np.ones(vocab, dtype=bool)
    for i, w in enumerate(_token_bytes(tokenizer)[:vocab]):
        if end in w and not w.endswith(end):
            mask[i] = False
        elif any(w.startswith(end[k:]) and len(w) > len(end) - k for k in started):
            mask[i] = False
    return mask


@functools.lru_cache(maxsize=4)
def _token_bytes(tokenizer) -> list:
    return [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]


class RowGrammar:
    """One row's constraint state. The lane `consume`s every token the row emits; within a cycle
    it `speculate`s the primary and the drafts it judges (each draft's and each verified
    position's `allowed` set comes after the tokens before it), then `unwind`s them before the
    row's decisions emit what it keeps. `allowed()`: a bool mask over the model's vocabulary,
    or None where every token is allowed (thinking, below its budget); `allows(token)`: one
    token's check. `ended`: the grammar is complete (only end-of-sequence allowed): the row
    stops there."""

    def __init__(self, constraint: Constraint, tokenizer, vocab: int):
        self.constraint, self.tokenizer, self.vocab = constraint, tokenizer, vocab
        self.matcher = (None if constraint.grammar is None
                        else _template_matcher(tokenizer, constraint.grammar).deep_copy())
        if self.matcher is not None and self.matcher.is_error():
            raise ConstraintError(f"{constraint.kind} cannot be enforced: {_first_line(self.matcher.get_error())}")
        self._bits = (None if self.matcher is None      # a thinking budget or min_tokens only
                      else np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32))
        self.tokens: list = []                 # consumed: committed, then speculated
        self.committed = 0
        self.answer_at: Optional[int] = 0 if constraint.think_end is None else None
        self._end = constraint.think_end.encode() if constraint.think_end else b""
        self._forced = (tokenizer.tokenize_str(constraint.think_end) if constraint.think_budget is not None
                        else [])
        self._think_bytes: list = []           # bytes of each thinking token
        self._kinds: list = []                 # per token: "think", "grammar" (the matcher has it) or "after"
        # masks by how many tokens they follow; those after unwound tokens wait in `_unwound` as
        # (token, mask after it), in case the row emits those tokens again (a kept draft)
        self._masks: dict = {}
        self._unwound: list = []
        self._held = _Held()
        GRAMMAR_MEMORY.add_row()
        weakref.finalize(self, lambda held=self._held: GRAMMAR_MEMORY.end_row(held.bytes))
        self._count()

    def _count(self) -> None:
        """Count what the row holds now (its masks, its bitmask buffer) in GRAMMAR_MEMORY."""
        masks = list(self._masks.values()) + [m for _, m in self._unwound]
        now = (0 if self._bits is None else self._bits.nbytes) + sum(m.nbytes for m in masks if m is not None)
        if now != self._held.bytes:
            GRAMMAR_MEMORY.update(self._held.bytes, now)
            self._held.bytes = now

    @property
    def memory_bytes(self) -> int:
        """The bytes this row's grammar holds of its own (masks, bitmask buffer); llguidance's
        lexer is its grammar's, shared (GRAMMAR_MEMORY.stats() bounds it)."""
        return self._held.bytes

    # state

    @property
    def thinking(self) -> bool:
        return self.answer_at is None

    @property
    def ended(self) -> bool:
        """The grammar is complete. A matcher in llguidance's error state is not an end but a
        fault (`GrammarError`): the row fails rather than return its text as if it were whole."""
        if self.thinking or self.matcher is None:
            return False
        self._check_error()
        return self.matcher.is_stopped()

    @property
    def spent(self) -> bool:
        """Nothing is left to enforce: no grammar, no thinking budget, the held-back tokens allowed
        again (a `min_tokens` row past its minimum decodes as an unconstrained row from here)."""
        return (self.matcher is None and self.constraint.think_budget is None
                and len(self.tokens) >= self.constraint.hold_until)

    def _check_error(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the {self.constraint.kind} grammar failed after {len(self.tokens)} tokens: "
                               f"{_first_line(self.matcher.get_error())}")

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next: a check of one token (a few microseconds),
        where `allowed()` computes the whole mask (about a hundred)."""
        if (self.thinking or self.matcher is None or self.matcher.is_stopped()
                or (self._holding(len(self.tokens)) and int(token) in self.constraint.hold_ids)):
            mask = self.allowed()
            return mask is None or bool(mask[int(token)])
        return self.matcher.validate_tokens([int(token)]) == 1

    def allowed(self) -> Optional[np.ndarray]:
        n = len(self.tokens)
        if n not in self._masks:
            mask = self._thinking_mask(n) if self.thinking else self._grammar_mask()
            self._masks[n] = self._held_back(mask) if self._holding(n) else mask
            self._count()
        return self._masks[n]

    def _holding(self, n: int) -> bool:
        return n < self.constraint.hold_until and bool(self.constraint.hold_ids)

    def _held_back(self, mask: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """`mask` without the held-back tokens; unchanged where they are all it allows (a grammar
        at its end: the end wins over min_tokens)."""
        held = np.ones(self.vocab, dtype=bool) if mask is None else mask.copy()
        held[[t for t in self.constraint.hold_ids if t < self.vocab]] = False
        return held if held.any() else mask

    def _thinking_mask(self, n: int) -> Optional[np.ndarray]:
        """Free thinking, but for a grammar after it no token that would end the marker and go on
        past it (those bytes would escape the grammar); past the budget, the marker forced."""
        budget = self.constraint.think_budget
        if budget is not None and n >= budget:
            mask = np.zeros(self.vocab, dtype=bool)
            mask[self._forced[min(n - budget, len(self._forced) - 1)]] = True
            return mask
        if self.matcher is None:
            return None
        tail = b"".join(self._think_bytes[-len(self._end):])
        started = [k for k in range(1, len(self._end)) if tail.endswith(self._end[:k])]
        return _marker_mask(self.tokenizer, self._end, self.vocab, tuple(started))

    def _grammar_mask(self) -> Optional[np.ndarray]:
        if self.matcher is None:
            return None
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        n = min(self.vocab, self.tokenizer.vocab_size)
        mask = np.unpackbits(self._bits.view(np.uint8), count=n, bitorder="little").view(bool)
        if n < self.vocab:            # the embedding's rows past the tokenizer's are never allowed
            mask = np.concatenate([mask, np.zeros(self.vocab - n, dtype=bool)])
        if not mask.any():                     # an error state fails the row rather than draw from nothing
            self._check_error()
            mask[self.tokenizer.eos_token] = True
        return mask

    # moves

    def consume(self, token: int) -> None:
        """A token the row emitted (after `unwind`)."""
        self.speculate(token)
        self.committed = len(self.tokens)
        # masks before the committed position are never read again (at a 248k vocabulary a
        # mask is 248 KB: a long row would keep hundreds of megabytes)
        self._masks = {n: m for n, m in self._masks.items() if n >= self.committed}
        self._count()

    def speculate(self, token: int) -> None:
        token = int(token)
        self.tokens.append(token)
        if self._unwound and self._unwound[0][0] == token:
            _, mask = self._unwound.pop(0)
            if mask is not None:
                self._masks[len(self.tokens)] = mask
        elif self._unwound:
            self._unwound = []
            self._count()
        if self.thinking:
            self._kinds.append("think")
            self._think_bytes.append(self.tokenizer.decode_bytes([token]))
            if self._end and self._end in b"".join(self._think_bytes[-len(self._end):]):
                self.answer_at = len(self.tokens)
        elif self.matcher is not None and not self.matcher.is_stopped():
            self._kinds.append("grammar")
            self.matcher.consume_token(token)
        else:
            self._kinds.append("after")

    def unwind(self) -> None:
        """Roll back every speculated token: the state is the committed tokens' again."""
        tail = self._kinds[self.committed:]
        if not tail:
            return
        if self.matcher is not None and tail.count("grammar"):
            self.matcher.rollback(tail.count("grammar"))
        if tail.count("think"):
            del self._think_bytes[-tail.count("think"):]
        self._unwound = [(t, self._masks.pop(self.committed + 1 + i, None))
                         for i, t in enumerate(self.tokens[self.committed:])]
        self._masks = {n: m for n, m in self._masks.items() if n <= self.committed}
        self._count()
        del self.tokens[self.committed:], self._kinds[self.committed:]
        if self.answer_at is not None and self.answer_at > self.committed:
            self.answer_at = None
