"""`mtplx bench exactness`: how often greedy MTP output differs from plain greedy decoding, in the
served configuration, against an oracle that shares no code with ours.

The oracle is mlx-lm's own `generate_step` on a target-only copy of the checkpoint. Ours: MTP at
every depth (1-3) and a running lane at the app's widest width, rows joining together, all under
the BLAS thread count the replica serves with (1). For every row that differs, the first
differing position is examined with the oracle's own forward over the shared prefix: the two
tokens' logits there and their margin. A float32 near-tie is a margin within what the two
computations' rounding can move (reported against the logits' scale); anything wider is a bug.
Prompts are windows of the Python standard library's sources (every machine has them).
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

# float32 products of a d-length dot product round differently by up to about d * eps * |terms|;
# the report shows each divergence's margin beside this scale (eps * the logits' max magnitude)
EPS32 = float(np.finfo(np.float32).eps)


def stdlib_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list:
    """`n` prompts of `length` tokens: windows of the standard library's Python sources."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        ids = tokenizer.encode(rng.choice(files).read_text(errors="ignore"))
        if len(ids) > length + 1:
            start = rng.randrange(0, len(ids) - length)
            prompts.append(list(ids[start:start + length]))
    return prompts


def oracle_runs(model_dir: Path, prompts: list, tokens: int) -> tuple:
    """mlx-lm alone: its model from a target-only copy, and its greedy tokens per prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load

    from benchmarks.servers import make_peer_checkpoint

    copy = Path(tempfile.mkdtemp(prefix="mtplx-oracle-"))
    make_peer_checkpoint(model_dir, copy)
    lm, _ = mlx_lm_load(str(copy))
    runs = [[t for t, _ in generate_step(mx.array(ids), lm, max_tokens=tokens)] for ids in prompts]
    return lm, runs


def margin_at(lm, ids: list, expected: int, got: int) -> dict:
    """The oracle's logits at the first differing position: its token's, ours', their margin."""
    import mlx.core as mx

    logits = lm(mx.array([ids]))[0, -1].astype(mx.float32)
    row = np.array(logits)
    return {"oracle_logit": float(row[expected]), "our_logit": float(row[got]),
            "margin": float(row[expected] - row[got]), "scale": EPS32 * float(np.abs(row).max()),
            "our_token_is_runner_up": int(np.argsort(-row)[1]) == got}


def ours(model, prompts: list, tokens: int, widths: tuple) -> dict:
    """Our greedy tokens per prompt: MTP at depths 1-3 (solo), and rows of the service with the
    app's lanes and depths (greedy depths chosen by cost), all prompts submitted as one cohort."""
    from mtplx.engine.decode import generate_mtpk
    from mtplx.sampling import GREEDY
    from mtplx.scheduler.config import GREEDY_DEPTHS_BY_COST
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    out = {f"mtp depth {d}": [generate_mtpk(model, ids, max_tokens=tokens, sampler=GREEDY, depth=d).tokens
                              for ids in prompts] for d in (1, 2, 3)}
    service = MTPBatchGenerationService.for_model(model, widths=widths, greedy_depths=GREEDY_DEPTHS_BY_COST,
                                                  sampled_depth=2)
    try:
        jobs = [MTPBatchJob(str(i), ids, tokens, sampler=GREEDY) for i, ids in enumerate(prompts)]
        out[f"service widths {'/'.join(map(str, widths))}"] = [
            f.result()["tokens"] for f in service.submit_cohort(jobs)]
    finally:
        service.shutdown()
    return out


def bench_exactness(model_path: Optional[str], n_prompts: int, tokens: int, widths: tuple = (3, 8, 16, 32),
                    blas_threads: int = 1) -> dict:
    import mtplx
    from mtplx.runtime import set_blas_threads

    model = mtplx.load_model(model_path)
    threads = set_blas_threads(blas_threads)
    prompts = stdlib_prompts(model.tokenizer, n_prompts, 64)
    lm, oracle = oracle_runs(Path(model.path), prompts, tokens)
    result = {"model": model.model_id, "prompts": n_prompts, "tokens": tokens, "blas_threads": threads,
              "arms": {}}
    for arm, runs in ours(model, prompts, tokens, widths).items():
        divergences = []
        for ids, want, got in zip(prompts, oracle, runs):
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
            if at is not None:
                divergences.append(dict(position=at, **margin_at(lm, ids + want[:at], want[at], got[at])))
        result["arms"][arm] = {"rows_differing": len(divergences), "rows": n_prompts,
                               "divergences": divergences}
    return result


def render(result: dict) -> str:
    lines = [f"greedy exactness on {result['model']}: {result['prompts']} prompts x {result['tokens']} tokens, "
             f"{result['blas_threads']} BLAS thread(s), against mlx-lm's generate_step", "",
             "| arm | rows differing | first differing position: margin (oracle's top logit - ours), scale |",
             "|---|---|---|"]
    for arm, a in result["arms"].items():
        detail = "; ".join(f"{d['position']}: {d['margin']:.3g} ({d['scale']:.2g})" for d in a["divergences"]) or "-"
        lines.append(f"| {arm} | {a['rows_differing']}/{a['rows']} | {detail} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="mtplx bench exactness", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = bench_exactness(a.model, a.prompts, a.tokens)
    print(render(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
