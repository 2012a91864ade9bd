"""Benchmarks, measured side by side in one process (the machine is shared and noisy: compare
ratios from the same run, report medians).

  solo  - AR vs MTP, greedy and sampled (greedy MTP also vs mlx-lm's `generate_step`);
          acceptance, tokens per verify, ms per cycle, the speedup ceiling
          (1 + acceptance) x cost(AR step) / cost(MTP cycle); and the same with the optimized
          BLAS turned off (a child process, since BLAS loads at import).
  lane  - serial solo AR / solo MTP vs the B8 lane, B3 vs B8 at 3 rows, a 2-row cohort, and
          mlx-lm's BatchGenerator on the same prompts and weights; the B8 lane with its cycle
          graphs compiled vs eager; forward costs [B,T]; ms and host ms per B8 cycle, and a
          sampled B8 cycle against a greedy one run beside it (`b8_cycle_vs_greedy`); greedy B8
          and B2 lanes chaining 2 and 3 drafts a cycle against one (`depth_vs_one_draft`).
  Both report, for hybrid (GDN) models, capture-commit vs a plain verify forward.

Each bench (and `service`, `http`) also has a report: `render_*` writes its section of
BENCHMARKS.md, `plot_*` its chart (`benchmarks.report.write_report` puts them in place).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import List

import mlx.core as mx
import numpy as np

from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.settings import EngineSettings
from mtplx.engine.row import A3BMTPBatchRequest
from benchmarks.report import grouped_bars, machine_line, pyplot, save_figure
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.sampling import SamplerConfig

BENCH_PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
    "# Parse the command line\nimport argparse\n", "for i in range(10):\n", "try:\n    import json\n",
    "'''Utilities for working with files.'''\n", "def read_lines(path):\n    with open(path) as f:\n",
]
GREEDY = SamplerConfig(temperature=0.0)
SAMPLED = SamplerConfig(temperature=0.6)           # MTPLX's defaults otherwise: top_p 0.95, top_k 20


def _median(xs):
    return float(statistics.median(xs))


def _prompt_ids(model, n):
    return [model.tokenizer.encode(t) for t in (BENCH_PROMPTS * 2)[:n]]


def _solo_round(model, prompts, tokens, sampler, mtp: bool, first_seed: int = 0):
    """Serial solo decode of all prompts: aggregate decode tok/s and summed counters."""
    decode_s = n_tok = acc = rej = cycles = 0
    for i, p in enumerate(prompts, start=first_seed):
        if mtp:
            r = generate_mtpk(model, p, tokens, sampler, seed=i)
            acc, rej, cycles = acc + r.stats["accepted_drafts"], rej + r.stats["rejected_drafts"], cycles + r.stats["verify_calls"]
        else:
            r = generate_ar(model, p, tokens, sampler, seed=i)
        decode_s += r.stats["decode_elapsed_s"]
        n_tok += len(r.tokens)
    return {"tok_s": n_tok / decode_s, "tokens": n_tok, "decode_s": decode_s,
            "accepted": acc, "rejected": rej, "cycles": cycles}


def _mlx_lm_solo_round(model, prompts, tokens):
    """mlx-lm's own greedy decode loop (`generate_step`) over the same prompts and weights."""
    from mlx_lm.generate import generate_step

    decode_s = n_tok = 0
    for p in prompts:
        steps = generate_step(mx.array(p), model.target, max_tokens=tokens)
        next(steps)                       # the first token comes from prefill
        t = time.perf_counter()
        n = sum(1 for _ in steps)
        decode_s, n_tok = decode_s + time.perf_counter() - t, n_tok + n
    return {"tok_s": n_tok / decode_s, "tokens": n_tok, "decode_s": decode_s}


def _summed(parts: list) -> dict:
    """One round's arm from its per-prompt parts: counters summed, tok/s recomputed."""
    out = {k: sum(p[k] for p in parts) for k in parts[0] if k != "tok_s"}
    out["tok_s"] = out["tokens"] / out["decode_s"]
    return out


def bench_solo(model, tokens=128, n_prompts=8, rounds=3, blas_off_child=True) -> dict:
    prompts = _prompt_ids(model, n_prompts)
    generate_mtpk(model, prompts[0], 8, GREEDY)  # warm up
    out = {}
    for name, sampler in (("greedy", GREEDY), ("t0.6", SAMPLED)):
        ar, mtp, mlx_lm_ar = [], [], []
        for _ in range(rounds):  # arms interleaved prompt by prompt, so a noisy spell hits every arm
            parts = {"ar": [], "mtp": [], "mlx_lm": []}
            for i, p in enumerate(prompts):
                parts["ar"].append(_solo_round(model, [p], tokens, sampler, mtp=False, first_seed=i))
                parts["mtp"].append(_solo_round(model, [p], tokens, sampler, mtp=True, first_seed=i))
                if sampler is GREEDY:
                    parts["mlx_lm"].append(_mlx_lm_solo_round(model, [p], tokens))
            ar.append(_summed(parts["ar"]))
            mtp.append(_summed(parts["mtp"]))
            if parts["mlx_lm"]:
                mlx_lm_ar.append(_summed(parts["mlx_lm"]))
        ar_tok_s, mtp_tok_s = _median([r["tok_s"] for r in ar]), _median([r["tok_s"] for r in mtp])
        speedup = _median([b["tok_s"] / a["tok_s"] for a, b in zip(ar, mtp)])   # per-round ratios
        m = mtp[0]
        acceptance = m["accepted"] / max(m["accepted"] + m["rejected"], 1)
        ms_cycle = _median([r["decode_s"] / r["cycles"] for r in mtp]) * 1e3
        ms_ar_step = _median([r["decode_s"] / r["tokens"] for r in ar]) * 1e3
        out[name] = {
            "ar_tok_s": round(ar_tok_s, 1), "mtp_tok_s": round(mtp_tok_s, 1),
            "speedup": round(speedup, 3), "acceptance": round(acceptance, 3),
            "tokens_per_verify": round(m["tokens"] / m["cycles"], 3),
            "ms_per_ar_step": round(ms_ar_step, 2), "ms_per_mtp_cycle": round(ms_cycle, 2),
            "ceiling": round((1 + acceptance) * ms_ar_step / ms_cycle, 3),
        }
        if mlx_lm_ar:
            mlx_lm_tok_s = _median([r["tok_s"] for r in mlx_lm_ar])
            out[name]["mlx_lm_ar_tok_s"] = round(mlx_lm_tok_s, 1)
            out[name]["speedup_vs_mlx_lm_ar"] = round(
                _median([b["tok_s"] / c["tok_s"] for b, c in zip(mtp, mlx_lm_ar)]), 3)
    out["forward_ms"] = forward_costs(model, [(1, 1), (1, 2)])
    capture = capture_commit_costs(model, 1)
    if capture:
        out["capture_commit"] = capture
    if blas_off_child:
        out["blas_off"] = _child_bench(["solo", "--model", str(model.path), "--tokens", "32", "--prompts", "2",
                                        "--rounds", "1"], {"MTPLX_BLAS": "off"})
    return out


def _child_bench(args, env_extra) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "benchmarks", *args, "--json", "--no-child", "--no-report"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return {"error": res.stderr[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cohort_caches(model, B: int, ctx: int) -> list:
    """Target caches of a B-row lane, each row prefilled alone with `ctx` tokens, then put into
    its row as a running lane does (any layer type)."""
    from mtplx.models.cache import empty_batch_layer

    per = [model.make_cache() for _ in range(B)]
    for pc in per:
        model.hidden(mx.array([[1] * ctx]), pc)
    lanes = [empty_batch_layer(c, B) for c in per[0]]
    for b, pc in enumerate(per):
        for layer, c in zip(lanes, pc):
            layer.put_row(b, c)
    return lanes


def forward_costs(model, shapes, ctx=64, n=20) -> dict:
    """ms per target forward of [B, T] over a ragged cache of `ctx` tokens per row."""
    out = {}
    for B, T in shapes:
        caches = _cohort_caches(model, B, ctx)
        x = mx.ones((B, T), dtype=mx.uint32)
        times = []
        for i in range(n + 3):
            t = time.perf_counter()
            mx.eval(mx.argmax(model.logits(model.hidden(x, caches)), axis=-1))
            for c in caches:
                c.advance(np.full(B, -T))
            if i >= 3:
                times.append(time.perf_counter() - t)
        out[f"[{B},{T}]"] = round(_median(times) * 1e3, 2)
    return out


def capture_commit_costs(model, B, ctx=64, n=20):
    """Hybrid (GDN) models: ms per [B, 2] verify through the capturing GDN forward plus a commit
    of mixed keeps (rows keep 0/1/2), against mlx-lm's plain forward of the same shape that keeps
    no per-position state and commits nothing; eager, and as compiled graphs like the lane's.
    None for attention-only models."""
    from mlx_lm.models.cache import ArraysCache

    from mtplx.models.cache import RaggedKVCache, commit_rows
    from mtplx.models.recurrent_cache import RecurrentCache

    if not any(isinstance(c, RecurrentCache) for c in model.make_cache()):
        return None
    caches = _cohort_caches(model, B, ctx)
    kv = [c for c in caches if isinstance(c, RaggedKVCache)]
    gdn = [c for c in caches if isinstance(c, RecurrentCache)]
    saved = [c.graph_inputs() for c in caches], [(c.lengths, c.offset) for c in kv]
    keep = np.arange(B) % 3
    x = mx.ones((B, 2), dtype=mx.uint32)

    def views(arrays, offset, plain):
        out = []
        for i, c in enumerate(caches):
            if plain and isinstance(c, RecurrentCache):   # mlx-lm's own GDN forward: no capture
                v = ArraysCache(2)
                v[0], v[1] = arrays[2 * i], arrays[2 * i + 1]
            else:
                v = type(c).graph_view(arrays[2 * i:2 * i + 2], offset)
            out.append(v)
        return out

    def graph(plain):
        def verify(x, offset, *arrays):
            vs = views(arrays, offset, plain)
            ids = mx.argmax(model.logits(model.hidden(x, vs)), axis=-1)
            return (ids,) + tuple(a for v in vs for a in (v.cache if type(v) is ArraysCache else v.graph_outputs()))
        return mx.compile(verify)

    compiled = {plain: graph(plain) for plain in (True, False)}

    def plain_eager():
        vs = [c if isinstance(c, RaggedKVCache) else ArraysCache(2) for c in caches]
        for v, c in zip(vs, caches):
            if v is not c:
                v[0], v[1] = c[0], c[1]
        mx.eval(mx.argmax(model.logits(model.hidden(x, vs)), axis=-1), [v.cache for v in vs if type(v) is ArraysCache])

    def capture_eager():
        mx.eval(mx.argmax(model.logits(model.hidden(x, caches)), axis=-1))
        commit_rows(caches, 2, keep)
        mx.eval([c.cache for c in gdn])

    def plain_compiled():
        mx.eval(compiled[True](x, kv[0].offset, *[a for c in caches for a in c.graph_inputs()]))

    def capture_compiled():
        out = compiled[False](x, kv[0].offset, *[a for c in caches for a in c.graph_inputs()])
        rest = iter(out[1:])
        for c in caches:
            c.absorb_graph(rest, 2, kv[0].offset + 2)
        commit_rows(caches, 2, keep)
        mx.eval(out[0], [c.cache for c in gdn], [c.keys for c in kv])

    def restore():
        for c, arrays in zip(caches, saved[0]):
            if isinstance(c, RecurrentCache):
                c[0], c[1] = arrays
                c.clear_capture()
            else:
                c.keys, c.values = arrays
        for c, (lengths, offset) in zip(kv, saved[1]):
            c.lengths, c.offset = lengths, offset

    arms = {"eager plain": plain_eager, "eager capture_commit": capture_eager,
            "compiled plain": plain_compiled, "compiled capture_commit": capture_compiled}
    times = {k: [] for k in arms}
    for i in range(n + 3):
        for name, fn in arms.items():   # interleaved
            t = time.perf_counter()
            fn()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
            restore()
    ms = {k: _median(v) * 1e3 for k, v in times.items()}
    out = {f"[{B},2] {k} ms": round(v, 2) for k, v in ms.items()}
    for mode in ("eager", "compiled"):
        out[f"{mode} overhead"] = round(ms[f"{mode} capture_commit"] / ms[f"{mode} plain"] - 1, 3)
    return out


def _lane_round(lane, prompts, tokens, sampler, draft_draw=None):
    reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=sampler, max_tokens=tokens, seed=i)
            for i, p in enumerate(prompts)]
    t = time.perf_counter()
    res = generate_a3b_mtp_batch(lane, reqs, draft_draw=draft_draw)
    n = sum(len(s.tokens) for s in res.streams)
    per_row = [len(s.tokens) / (s.terminal_perf_s - (t + res.prefill_s)) for s in res.streams]
    return {"tok_s": n / res.decode_s, "per_row_tok_s": _median(per_row),
            "acceptance": res.accepted_drafts / max(res.accepted_drafts + res.rejected_drafts, 1),
            "cycles": res.cycles, "ms_per_cycle": res.decode_s / res.cycles * 1e3,
            "host_ms_per_cycle": res.host_s / res.cycles * 1e3}


def _mlx_lm_batch_round(model, prompts, tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model.target, max_tokens=tokens, stop_tokens=[])
    gen.insert(prompts, [tokens] * len(prompts))
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    return {"tok_s": stats.generation_tps}


def bench_lane(model, tokens=256, rounds=3) -> dict:
    prompts8 = _prompt_ids(model, 8)
    lanes = {w: install_a3b_mtp_batch_lane(model, w) for w in (2, 3, 8)}
    other8 = install_a3b_mtp_batch_lane(model, 8, selfcheck=False, compiled=not lanes[8].compiled)
    # greedy cycles chaining 2-3 drafts (their exactness is the tests'; here only their speed)
    chained = {(w, d): install_a3b_mtp_batch_lane(model, w, selfcheck=False, depth=d) for w in (2, 8) for d in (2, 3)}
    for lane in [lanes[8], *chained.values()]:
        _lane_round(lane, prompts8[:lane.width], 8, GREEDY)  # warm up
    draw = EngineSettings().draft_draw
    other_draw = "host" if draw == "device" else "device"
    out = {"draft_draw": draw}
    for name, sampler in (("greedy", GREEDY), ("t0.6", SAMPLED)):
        arms = {
            "serial_ar": lambda: _solo_round(model, prompts8, tokens, sampler, mtp=False),
            "serial_mtp": lambda: _solo_round(model, prompts8, tokens, sampler, mtp=True),
            "b8_8rows": lambda: _lane_round(lanes[8], prompts8, tokens, sampler),
            "b3_3rows": lambda: _lane_round(lanes[3], prompts8[:3], tokens, sampler),
            "b8_3rows": lambda: _lane_round(lanes[8], prompts8[:3], tokens, sampler),
            "b2_2rows": lambda: _lane_round(lanes[2], prompts8[:2], tokens, sampler),
            "serial_mtp_2rows": lambda: _solo_round(model, prompts8[:2], tokens, sampler, mtp=True),
        }
        if sampler is not GREEDY:
            arms["b8_8rows_greedy"] = lambda: _lane_round(lanes[8], prompts8, tokens, GREEDY)
            arms["b8_8rows_other_draw"] = lambda: _lane_round(lanes[8], prompts8, tokens, sampler, other_draw)
        if sampler is GREEDY:
            arms["mlx_lm_batch_8rows"] = lambda: _mlx_lm_batch_round(model, prompts8, tokens)
            arms["b8_8rows_other_mode"] = lambda: _lane_round(other8, prompts8, tokens, sampler)
            for (w, d), lane in chained.items():   # greedy cycles chaining d drafts
                arms[f"b{w}_{w}rows_depth{d}"] = functools.partial(_lane_round, lane, prompts8[:w], tokens, sampler)
        runs = {k: [] for k in arms}
        for _ in range(rounds):  # interleaved, so a noisy spell hits every arm alike
            for k, fn in arms.items():
                runs[k].append(fn())
        row = {k: {m: round(_median([r[m] for r in rs]), 3) for m in rs[0]} for k, rs in runs.items()}
        if sampler is GREEDY:
            row["b8_vs_serial_mtp"] = round(row["b8_8rows"]["tok_s"] / row["serial_mtp"]["tok_s"], 3)
            row["b8_vs_mlx_lm_batch"] = round(row["b8_8rows"]["tok_s"] / row["mlx_lm_batch_8rows"]["tok_s"], 3)
            compiled, eager = ((row["b8_8rows"], row["b8_8rows_other_mode"]) if lanes[8].compiled
                               else (row["b8_8rows_other_mode"], row["b8_8rows"]))
            row["b8_compiled_vs_eager"] = round(compiled["tok_s"] / eager["tok_s"], 3)
            row["depth_vs_one_draft"] = {f"b{w}_depth{d}": round(row[f"b{w}_{w}rows_depth{d}"]["tok_s"]
                                                                 / row[f"b{w}_{w}rows"]["tok_s"], 3)
                                         for w, d in chained}
        else:
            row["b8_vs_serial_mtp"] = round(row["b8_8rows"]["tok_s"] / row["serial_mtp"]["tok_s"], 3)
            # the cost of sampling: a sampled B8 cycle against a greedy one measured beside it
            row["b8_cycle_vs_greedy"] = round(row["b8_8rows"]["ms_per_cycle"] / row["b8_8rows_greedy"]["ms_per_cycle"], 3)
            # drafts drawn on the device (one wait a cycle) against the host (two), beside each other
            device, host = ((row["b8_8rows"], row["b8_8rows_other_draw"]) if draw == "device"
                            else (row["b8_8rows_other_draw"], row["b8_8rows"]))
            row["b8_device_draw_vs_host"] = round(device["tok_s"] / host["tok_s"], 3)
        row["b2_vs_serial_mtp_2rows"] = round(row["b2_2rows"]["tok_s"] / row["serial_mtp_2rows"]["tok_s"], 3)
        row["b3_vs_b8_at_3rows"] = round(row["b3_3rows"]["tok_s"] / row["b8_3rows"]["tok_s"], 3)
        out[name] = row
    out["forward_ms"] = forward_costs(model, [(1, 1), (1, 2), (2, 2), (3, 1), (3, 2), (8, 1), (8, 2), (8, 3), (8, 4)])
    capture = capture_commit_costs(model, 8)
    if capture:
        out["capture_commit"] = capture
    return out


# ----------------------------------------------------------------------------------------------
# Reports: each bench's section of BENCHMARKS.md and its chart (written by benchmarks.report)


def _cell(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _header(record: dict, title: str) -> List[str]:
    return [f"## bench {record['bench']}: {title}", "",
            f"`{record['command']}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. Model: {record['model']}.",
            machine_line(record["machine"]), ""]


def render_solo(record: dict, image: str) -> str:
    o = record["options"]
    lines = _header(record, "AR vs MTP, one request at a time") + [
        f"{o['prompts']} prompts x {o['tokens']} tokens, {o['rounds']} round(s); the arms (our AR, our MTP, and for",
        "greedy mlx-lm's `generate_step`) alternate prompt by prompt; figures are medians over rounds, MTP/AR",
        "the median of per-round ratios. Ceiling: (1 + acceptance) x ms per AR step / ms per MTP cycle.",
        "",
        "| sampler | AR tok/s | MTP tok/s | MTP/AR | mlx-lm AR tok/s | MTP/mlx-lm | acceptance | tokens/verify "
        "| ms/AR step | ms/MTP cycle | ceiling |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("greedy", "t0.6"):
        r = record[name]
        lines.append(f"| {name} | {r['ar_tok_s']:.1f} | {r['mtp_tok_s']:.1f} | {r['speedup']:.2f} "
                     f"| {_cell(r.get('mlx_lm_ar_tok_s'))} | {_cell(r.get('speedup_vs_mlx_lm_ar'), 2)} "
                     f"| {r['acceptance']:.3f} | {r['tokens_per_verify']:.2f} | {r['ms_per_ar_step']:.2f} "
                     f"| {r['ms_per_mtp_cycle']:.2f} | {r['ceiling']:.2f} |")
    lines += ["", "Target forward, ms: " + ", ".join(f"{k} {v}" for k, v in record["forward_ms"].items()) + "."]
    off = record.get("blas_off")
    if off and "greedy" in off:
        lines.append(f"With the reference BLAS (`MTPLX_BLAS=off`, 2 prompts x 32 tokens, 1 round, a child process): "
                     f"greedy AR {off['greedy']['ar_tok_s']:.1f}, MTP {off['greedy']['mtp_tok_s']:.1f} tok/s.")
    elif off:
        lines.append(f"The reference-BLAS child run failed: {off.get('error', '')[-200:]!r}.")
    lines += _capture_commit_lines(record)
    return "\n".join(lines + ["", f"![bench solo]({image})"]) + "\n"


def _capture_commit_lines(record: dict) -> list:
    if not record.get("capture_commit"):
        return []
    return ["Capture-commit vs a plain verify forward: " +
            ", ".join(f"{k} {v}" for k, v in record["capture_commit"].items()) + "."]


def plot_solo(record: dict, path) -> None:
    plt = pyplot()
    fig, (ax_tok, ax_ms) = plt.subplots(1, 2, figsize=(11, 4.2))
    samplers = ["greedy", "t0.6"]
    grouped_bars(ax_tok, samplers, {
        "our AR": [record[s]["ar_tok_s"] for s in samplers],
        "our MTP": [record[s]["mtp_tok_s"] for s in samplers],
        "mlx-lm AR": [record[s].get("mlx_lm_ar_tok_s") for s in samplers]}, "tok/s", "decode throughput, one request")
    grouped_bars(ax_ms, samplers, {
        "ms per AR step": [record[s]["ms_per_ar_step"] for s in samplers],
        "ms per MTP cycle": [record[s]["ms_per_mtp_cycle"] for s in samplers]}, "ms", "cost of one step", digits=2)
    save_figure(fig, path, record)


LANE_ARMS = {   # arm -> what it decodes
    "serial_ar": "8 rows one after another, solo AR",
    "serial_mtp": "8 rows one after another, solo MTP",
    "b8_8rows": "8 rows in the B8 lane",
    "b8_8rows_other_mode": "8 rows in the B8 lane, cycle graphs compiled/eager the other way",
    "mlx_lm_batch_8rows": "8 rows in mlx-lm's BatchGenerator (AR)",
    "b8_8rows_greedy": "8 greedy rows in the B8 lane, beside the sampled arm",
    "b8_8rows_other_draw": "8 rows in the B8 lane, sampled drafts drawn on the device/host the other way",
    "b3_3rows": "3 rows in the B3 lane",
    "b8_3rows": "3 rows in the B8 lane",
    "b2_2rows": "2 rows in the B2 lane",
    "serial_mtp_2rows": "2 rows one after another, solo MTP",
    "b8_8rows_depth2": "8 rows in a B8 lane chaining 2 drafts a cycle",
    "b8_8rows_depth3": "8 rows in a B8 lane chaining 3 drafts a cycle",
    "b2_2rows_depth2": "2 rows in a B2 lane chaining 2 drafts a cycle",
    "b2_2rows_depth3": "2 rows in a B2 lane chaining 3 drafts a cycle",
}


def render_lane(record: dict, image: str) -> str:
    o = record["options"]
    lines = _header(record, "rows decoded together in a lane") + [
        f"{o['tokens']} tokens a row, {o['rounds']} round(s); every arm runs once per round, in turn; figures are",
        "medians over rounds. tok/s: all rows' tokens / decode time; ms/cycle and host ms/cycle (time the",
        "host spends outside the device's work) for lane arms.",
        "",
        "| arm | greedy tok/s | greedy ms/cycle | greedy host ms/cycle | t0.6 tok/s | t0.6 ms/cycle | t0.6 host ms/cycle |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, what in LANE_ARMS.items():
        g, s = record["greedy"].get(arm, {}), record["t0.6"].get(arm, {})
        if not g and not s:
            continue
        lines.append(f"| {what} | {_cell(g.get('tok_s'))} | {_cell(g.get('ms_per_cycle'), 2)} "
                     f"| {_cell(g.get('host_ms_per_cycle'), 2)} | {_cell(s.get('tok_s'))} "
                     f"| {_cell(s.get('ms_per_cycle'), 2)} | {_cell(s.get('host_ms_per_cycle'), 2)} |")
    g, s = record["greedy"], record["t0.6"]
    lines += ["",
              f"B8 lane vs serial solo MTP: greedy {g['b8_vs_serial_mtp']:.2f}x, t0.6 {s['b8_vs_serial_mtp']:.2f}x. "
              f"B8 vs mlx-lm's BatchGenerator (greedy): {g['b8_vs_mlx_lm_batch']:.2f}x. "
              f"Compiled vs eager B8 (greedy): {g['b8_compiled_vs_eager']:.2f}x. "
              f"A sampled B8 cycle costs {s['b8_cycle_vs_greedy']:.2f}x a greedy one. "
              + (f"Sampled drafts are drawn on the {record['draft_draw']} by default; drawn on the device "
                 f"they give {s['b8_device_draw_vs_host']:.2f}x the tok/s of host draws. "
                 if "b8_device_draw_vs_host" in s else "") +
              f"B2 vs serial solo MTP at 2 rows: greedy {g['b2_vs_serial_mtp_2rows']:.2f}x; "
              f"B3 vs B8 at 3 rows: greedy {g['b3_vs_b8_at_3rows']:.2f}x."
              + ("" if "depth_vs_one_draft" not in g else
                 " Greedy cycles chaining 2 / 3 drafts against one (same rows, same width): B8 "
                 f"{g['depth_vs_one_draft']['b8_depth2']:.2f}x / {g['depth_vs_one_draft']['b8_depth3']:.2f}x, "
                 f"B2 {g['depth_vs_one_draft']['b2_depth2']:.2f}x / {g['depth_vs_one_draft']['b2_depth3']:.2f}x."),
              "",
              "Target forward, ms: " + ", ".join(f"{k} {v}" for k, v in record["forward_ms"].items()) + "."]
    lines += _capture_commit_lines(record)
    return "\n".join(lines + ["", f"![bench lane]({image})"]) + "\n"


def plot_lane(record: dict, path) -> None:
    plt = pyplot()
    fig, (ax8, ax_few) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    eight = ["serial_ar", "serial_mtp", "mlx_lm_batch_8rows", "b8_8rows"]
    few = ["serial_mtp_2rows", "b2_2rows", "b3_3rows", "b8_3rows"]
    labels = {"serial_ar": "serial AR", "serial_mtp": "serial MTP", "mlx_lm_batch_8rows": "mlx-lm batch",
              "b8_8rows": "B8 lane", "serial_mtp_2rows": "2 serial MTP", "b2_2rows": "B2, 2 rows",
              "b3_3rows": "B3, 3 rows", "b8_3rows": "B8, 3 rows"}
    for ax, arms, title in ((ax8, eight, "8 rows"), (ax_few, few, "2-3 rows")):
        grouped_bars(ax, [labels[a] for a in arms],
                     {s: [record[s].get(a, {}).get("tok_s") for a in arms] for s in ("greedy", "t0.6")},
                     "tok/s (all rows)", title)
    save_figure(fig, path, record)


def render_service(record: dict, image: str) -> str:
    lines = _header(record, "the service's overhead over the lane driver") + [
        f"One greedy cohort of {record['n_prompts']} rows (budgets {record['budgets'][0]}-{record['budgets'][-1]} tokens, "
        f"{record['completion_tokens']} in all, stop tokens off) in the B{record['fixed_width']} lane: the driver called",
        f"directly on the model-owner thread vs {record['n_prompts']} concurrent `submit`s through the service "
        f"(gather window {record['batch_wait_s'] * 1000:.0f} ms);",
        f"{record['rounds']} round(s), arms alternating; tok/s from the median wall time.",
        "",
        "| direct tok/s | service tok/s | overhead | same tokens |",
        "|---:|---:|---:|---|",
        f"| {record['direct_tok_s']:.1f} | {record['service_tok_s']:.1f} | {record['overhead_pct']:.1f}% "
        f"| {'yes' if record['identical_tokens'] else '**no**'} |",
    ]
    return "\n".join(lines + ["", f"![bench service]({image})"]) + "\n"


def plot_service(record: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    total = record["completion_tokens"]
    rounds = [f"round {i + 1}" for i in range(len(record["direct_wall_s"]))]
    grouped_bars(ax, rounds, {"driver, direct": [total / w for w in record["direct_wall_s"]],
                              "through the service": [total / w for w in record["service_wall_s"]]},
                 "tok/s (all rows)", f"{record['n_prompts']} greedy rows, B{record['fixed_width']} lane")
    save_figure(fig, path, record)
