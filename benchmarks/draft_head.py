"""A trained head's worth, in process: what its draft costs at the draft vocabulary against the
whole vocabulary, and what lanes of 1 and 8 greedy (or sampled) rows decode with it: plain AR,
MTP at each depth (as served; `_context`: greedy rows drafting from their context where it
beats the head, `context_drafts` on), and `auto` (rows that may step aside, the lane's depth
chosen by cost, as the service runs them). Arms run side by side, round by round (the machine is
shared and noisy: compare ratios from the same round, read medians).

    python -m benchmarks.draft_head MODEL_DIR [--tokens 64] [--rounds 3] [--widths 1,8]
                                              [--temperatures 0,0.6] [--prompts heldout|load]
                                              [--no-full-vocab] [--json]

Prompts: the held-out split of `mtplx train-head`'s default corpus (chat, prose and code the head
never trained on), or `load`: `bench load`'s code prompts (its first ones, as its clients send them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import mlx.core as mx

import mtplx
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.installed import DEPTHS, solo_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.settings import EngineSettings
from mtplx.sampling import SamplerConfig

WITH_CONTEXT = EngineSettings(context_drafts=True)


def draft_costs(model, widths=(1, 8), reps: int = 30) -> dict:
    """ms to turn a head's output into drafts (projection, and the argmax the greedy draft is):
    onto the draft vocabulary (scattered to the whole vocabulary, as the engine takes it) and
    onto the whole vocabulary, per width."""
    out = {}
    H = model.arch.hidden_size(model.target.args)
    arms = {"full_vocabulary": model.logits}
    if model.draft_vocab is not None:
        arms[f"draft_vocabulary_{model.draft_vocab.size}"] = model.draft_vocab.logits
    for w in widths:
        g = mx.random.normal((w, 1, H), key=mx.random.key(w))
        times = {k: [] for k in arms}
        for _ in range(reps):
            for name, fn in arms.items():          # interleaved
                t = time.perf_counter()
                mx.eval(mx.argmax(fn(g), axis=-1))
                times[name].append(time.perf_counter() - t)
        out[f"B{w}"] = {k: round(statistics.median(v[3:]) * 1e3, 2) for k, v in times.items()}
    return out


def _requests(prompts, width, tokens, sampler, mode) -> list:
    return [A3BMTPBatchRequest(request_id=f"{mode}-{i}", prompt_ids=prompts[i % len(prompts)], sampler=sampler,
                               max_tokens=tokens, seed=i, speculative=mode != "ar", adaptive=mode == "auto")
            for i in range(width)]


def run_lane(running: RunningLane, reqs) -> dict:
    """Decode the rows; tok/s over the steps after every row has its first token (prefill out)."""
    streams = [running.add(r) for r in reqs]
    while running.has_work and not all(s.tokens for s in streams):
        running.step()
    t0, n0 = time.perf_counter(), sum(len(s.tokens) for s in streams)
    steps = 0
    while running.has_work:
        running.step()
        steps += 1
    dt = time.perf_counter() - t0
    n = sum(len(s.tokens) for s in streams) - n0
    acc = sum(s.accepted_drafts for s in streams)
    rej = sum(s.rejected_drafts for s in streams)
    return {"tok_s": n / dt, "tokens": n, "steps": steps, "ms_per_step": 1e3 * dt / max(steps, 1),
            "drafts_kept": acc / max(acc + rej, 1), "tokens_a_row_step": n / max(steps, 1) / len(reqs)}


def lanes_for(model, width: int, depth: int):
    return solo_lane(model, depth) if width == 1 else install_a3b_mtp_batch_lane(model, width, depth=depth,
                                                                                 selfcheck=False)


def auto_lane(ladder, width: int) -> RunningLane:
    """A running lane as the service starts one (`MTPBatchGenerationService._start_lane`)."""
    by_cost = [ladder.ladder(d) for d in DEPTHS]
    return RunningLane(ladder.ladder(), greedy_ladder=ladder.greedy_ladder(),
                       sampled_ladder=ladder.ladder(ladder.sampled_depth), depth_ladders=by_cost)


def bench_prompts(model, which: str, n: int) -> list:
    if which == "load":
        from benchmarks.load.workload import prompt_for

        return [model.tokenizer.encode(prompt_for(i)) for i in range(n)]
    from mtplx.training.corpus import build_prompts
    from mtplx.training.train_head import MIX

    return [list(p.ids) for p in build_prompts(model.tokenizer, "heldout", n * 2, 7, MIX)][:n]


def bench(model, tokens=64, rounds=3, widths=(1, 8), temperatures=(0.0,), depths=DEPTHS, n_prompts=8,
          prompt_set: str = "heldout", full_vocab: bool = True) -> dict:
    from mtplx.scheduler.ladder import LaneLadder

    prompts = bench_prompts(model, prompt_set, n_prompts)
    full = dataclasses.replace(model, draft_vocab=None)       # the same head, projecting onto every row
    ladder = LaneLadder(model, greedy_depths="cost")
    ladder.install([w for w in widths if w > 1])
    # the draft vocabulary's lanes are the ladder's own (installed and measured once); the whole
    # vocabulary's, the same head's
    lanes = {(w, d, "draft"): {ln.width: ln for ln in ladder.ladder(d)}[w] for w in widths for d in depths}
    full_vocab = full_vocab and model.draft_vocab is not None
    if full_vocab:
        lanes.update({(w, d, "full"): lanes_for(full, w, d) for w in widths for d in depths})
    results: dict = {}
    for r in range(rounds):
        for t in temperatures:
            sampler = SamplerConfig(temperature=t)
            for w in widths:
                arms = {"ar": (RunningLane(lanes[(w, 1, "draft")]), "ar")}
                for d in depths:
                    arms[f"mtp_d{d}"] = (RunningLane(lanes[(w, d, "draft")]), "mtp")
                    arms[f"mtp_d{d}_context"] = (RunningLane(lanes[(w, d, "draft")], settings=WITH_CONTEXT), "mtp")
                    if full_vocab:
                        arms[f"mtp_d{d}_full_vocab"] = (RunningLane(lanes[(w, d, "full")]), "mtp")
                arms["auto"] = (auto_lane(ladder, w), "auto")
                for name, (running, mode) in arms.items():
                    out = run_lane(running, _requests(prompts, w, tokens, sampler, mode))
                    results.setdefault((t, w), {}).setdefault(name, []).append(out)
                ar = results[(t, w)]["ar"][-1]["tok_s"]
                line = "  ".join(f"{k} {v[-1]['tok_s']:.1f} ({v[-1]['tok_s'] / ar:.2f}x)"
                                 for k, v in results[(t, w)].items())
                print(f"round {r + 1} t{t} B{w}: {line}", flush=True)
    summary = {}
    for (t, w), arms in results.items():
        key = f"{'greedy' if t == 0 else f't{t}'} B{w}"
        summary[key] = {}
        for name, runs in arms.items():
            ratios = [x["tok_s"] / a["tok_s"] for x, a in zip(runs, arms["ar"])]
            summary[key][name] = {
                "tok_s": round(statistics.median(x["tok_s"] for x in runs), 2),
                "vs_ar": round(statistics.median(ratios), 3),
                "ms_per_step": round(statistics.median(x["ms_per_step"] for x in runs), 1),
                "drafts_kept": round(statistics.median(x["drafts_kept"] for x in runs), 3),
                "tokens_a_row_step": round(statistics.median(x["tokens_a_row_step"] for x in runs), 3)}
    return {"model": model.model_id, "prompts": prompt_set, "draft_vocabulary": None if model.draft_vocab is None else model.draft_vocab.size,
            "tokens": tokens, "rounds": rounds, "draft_ms": draft_costs(model, widths), "lanes": summary,
            "greedy_depths_by_cost": {str(k): v for k, v in ladder.greedy_depths.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.draft_head", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--prompts", choices=("heldout", "load"), default="heldout")
    ap.add_argument("--no-full-vocab", action="store_true", help="skip the arms drafting over the whole vocabulary")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = mtplx.load_model(a.model_dir)
    if model.mtp is None:
        raise SystemExit(f"{a.model_dir} has no MTP head: train one with `mtplx train-head`")
    out = bench(model, a.tokens, a.rounds, tuple(int(w) for w in a.widths.split(",")),
                tuple(float(t) for t in a.temperatures.split(",")), tuple(int(d) for d in a.depths.split(",")),
                prompt_set=a.prompts, full_vocab=not a.no_full_vocab)
    out["loadavg"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(out, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
