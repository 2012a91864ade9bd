"""Grammar engines on the shipped tokenizer, as measured before choosing llguidance: per schema of
`benchmarks.schemas`, the time to compile it, the time per token to compute the allowed set along
its valid example (compact JSON), and whether every token of the example is allowed. xgrammar and
outlines-core are not dependencies (xgrammar brings torch): `pip install xgrammar outlines-core`
first; an engine that is not installed is reported as not run.

    python -m benchmarks.grammar_engines
"""
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.schemas import SCHEMAS

# the shipped model's directory, found without importing MLX or Ray (this runs in any environment)
SHIPPED = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "mtplx-tiny-py"
def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    V = tok.vocab_size
    examples = [(s["schema"], tok.encode(json.dumps(s["example"], separators=(",", ":")))) for s in SCHEMAS]
    res = {}

    def run(name, compile_fn, walk_fn):
        comp, per_tok, ok, fails = [], [], 0, []
        for i, (schema, ids) in enumerate(examples):
            try:
                t0 = time.perf_counter(); g = compile_fn(schema); comp.append(time.perf_counter() - t0)
                t0 = time.perf_counter(); good = walk_fn(g, ids); per_tok.append((time.perf_counter() - t0) / (len(ids) + 1))
                ok += good
                if not good: fails.append(SCHEMAS[i]["name"])
            except Exception as exc:
                fails.append(f"{SCHEMAS[i]['name']}: {type(exc).__name__}: {str(exc)[:80]}")
        res[name] = dict(compile_ms_median=1e3 * statistics.median(comp) if comp else None,
                         compile_ms_max=1e3 * max(comp) if comp else None,
                         mask_us_per_token=1e6 * statistics.median(per_tok) if per_tok else None,
                         examples_accepted=f"{ok}/{len(examples)}", failures=fails[:6])

    # llguidance
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    lt = llguidance.hf.from_tokenizer(tok)
    def llg_compile(schema):
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lt, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m
    def llg_walk(m, ids):
        bm = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)
        for t in ids:
            llguidance.numpy.fill_next_token_bitmask(m, bm)
            allowed = (bm[0, t // 32] >> (t % 32)) & 1
            if not allowed or not m.consume_token(t):
                return False
        llguidance.numpy.fill_next_token_bitmask(m, bm)
        return True
    run("llguidance " + llguidance.__version__, llg_compile, llg_walk)

    # xgrammar
    try:
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        def xg_compile(schema):
            return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
        def xg_walk(m, ids):
            bm = xgr.allocate_token_bitmask(1, V)
            for t in ids:
                m.fill_next_token_bitmask(bm)
                if not ((int(bm[0, t // 32]) & 0xffffffff) >> (t % 32) & 1) or not m.accept_token(t):
                    return False
            m.fill_next_token_bitmask(bm)
            return True
        run("xgrammar " + __import__("importlib.metadata").metadata.version("xgrammar"), xg_compile, xg_walk)
    except Exception as exc:
        res["xgrammar"] = f"not run: {type(exc).__name__}: {exc}"

    # outlines-core
    try:
        import outlines_core
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        # its vocabulary: each token's string as the tokenizer's vocab writes it (byte-level), eos apart
        vmap = {}
        for s, i in tok.get_vocab().items():
            if i != tok.eos_token_id and i < V and s not in ("<|endoftext|>", "<|im_start|>"):
                vmap.setdefault(s, []).append(i)
        vocab = Vocabulary(tok.eos_token_id, vmap)
        def oc_compile(schema):
            return Index(build_regex_from_schema(json.dumps(schema)), vocab)
        def oc_walk(index, ids):
            g = Guide(index)
            for t in ids:
                if t not in set(g.get_tokens()):
                    return False
                g.advance(t)
            g.get_tokens()
            return True
        run("outlines-core " + getattr(outlines_core, "__version__", "0.2"), oc_compile, oc_walk)
    except Exception as exc:
        res["outlines-core"] = f"not run: {type(exc).__name__}: {exc}"
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
