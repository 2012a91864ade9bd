"""The lexer fuel llguidance needs on this project's structured-output workload, measured: for every
schema of `benchmarks.schemas`, as a JSON schema (`response_format`) and as a forced tool call's
arguments (`tools` + `tool_choice`), the least `initial_lexer_fuel` (building the grammar's lexer)
and `step_lexer_fuel` (one token's mask) with which its grammar compiles and its valid example
walks through, every token's mask computed, and the least `max_lexer_states` (the lexer's memory,
1-2 kB a state), each found by bisection with the others unbounded. `mtplx.structured`'s parser
limits are set from the largest (README, structured output).

    python -m benchmarks.grammar_fuel [MODEL_DIR | tokenizer.json]    # default: the shipped model's

The fuel a mask takes grows with the vocabulary (the lexer meets more of its states walking a
larger token trie): run it on a checkpoint's tokenizer to see what that checkpoint needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.schemas import SCHEMAS

SHIPPED = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "mtplx-tiny-py"
UNBOUNDED = 10 ** 12


def _walks(llg, tokenizer, grammar: str, tokens, initial: int, step: int, states: int = UNBOUNDED) -> bool:
    """Whether `grammar` compiles and `tokens` walk through it under these fuels and lexer states."""
    limits = llg.LLParserLimits(initial_lexer_fuel=initial, step_lexer_fuel=step,
                                max_lexer_states=min(states, 2 ** 31 - 1))
    is_error, _ = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits)
    if is_error:
        return False
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    bits = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    for t in list(tokens) + [None]:
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error() or (t is not None and not (matcher.consume_token(t) and not matcher.is_error())):
            return False
    return True


def least_fuel(ok, hi: int = 1 << 30) -> int:
    """The least fuel f (to within 1%) with ok(f), by bisection over [1, hi]."""
    if not ok(hi):
        raise RuntimeError("does not walk even with unbounded fuel")
    lo = 1
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def workload(tokenizer, hf_tokenizer):
    """(name, grammar, tokens of its valid output) for every schema, both ways it is asked for."""
    from mtplx.api.tools import ToolChoice, openai_tools, tool_call_constraint
    from mtplx.structured import json_schema_grammar

    for s in SCHEMAS:
        text = json.dumps(s["example"], separators=(",", ":"))
        yield f"{s['name']} json_schema", json_schema_grammar(s["schema"]), tokenizer.tokenize_str(text)
        tools = openai_tools([{"type": "function", "function": {"name": "record", "parameters": s["schema"]}}])
        constraint, _ = tool_call_constraint(tools, ToolChoice("required", None, False), after_thinking=False)
        call = '<tool_call>\n{"name": "record", "arguments": ' + json.dumps(s["example"], separators=(", ", ": "),
                                                                           ensure_ascii=False) + "}\n</tool_call>"
        yield f"{s['name']} tool_call", constraint.grammar, tokenizer.tokenize_str(call)


def main(source: str = str(SHIPPED)) -> dict:
    import llguidance as llg
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mtplx.structured import grammar_tokenizer

    hf = (PreTrainedTokenizerFast(tokenizer_file=source) if source.endswith(".json")
          else AutoTokenizer.from_pretrained(source))
    tokenizer = grammar_tokenizer(hf)
    rows = []
    for name, grammar, tokens in workload(tokenizer, hf):
        if not _walks(llg, tokenizer, grammar, tokens, UNBOUNDED, UNBOUNDED):
            rows.append({"name": name, "error": "the example does not walk through its grammar"})
            continue
        initial = least_fuel(lambda f: _walks(llg, tokenizer, grammar, tokens, f, UNBOUNDED))
        step = least_fuel(lambda f: _walks(llg, tokenizer, grammar, tokens, UNBOUNDED, f))
        states = least_fuel(lambda n: _walks(llg, tokenizer, grammar, tokens, UNBOUNDED, UNBOUNDED, n), 1 << 24)
        rows.append({"name": name, "tokens": len(tokens), "initial_lexer_fuel": initial, "step_lexer_fuel": step,
                     "lexer_states": states})
        print(f"{name:40s} {len(tokens):4d} tokens  initial {initial:>9,d}  step {step:>9,d}  lexer states "
              f"{states:>7,d}", flush=True)
    walked = [r for r in rows if "error" not in r]
    out = {"tokenizer": source, "vocab_size": tokenizer.vocab_size, "items": len(rows), "walked": len(walked),
           "max_initial_lexer_fuel": max(r["initial_lexer_fuel"] for r in walked),
           "max_step_lexer_fuel": max(r["step_lexer_fuel"] for r in walked),
           "max_lexer_states": max(r["lexer_states"] for r in walked),
           "llguidance_defaults": {"initial_lexer_fuel": llg.LLParserLimits().initial_lexer_fuel,
                                   "step_lexer_fuel": llg.LLParserLimits().step_lexer_fuel,
                                   "max_lexer_states": llg.LLParserLimits().max_lexer_states},
           "not_walked": [r["name"] for r in rows if "error" in r]}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:2])
