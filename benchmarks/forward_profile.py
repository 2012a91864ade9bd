"""`mtplx bench profile`: where one forward's time goes at the shapes a lane runs, on this
backend, for any checkpoint: the trunk (its attention and MLP blocks, and the rest: embedding,
norms, residuals), the output layer, the MTP head's draft, and the dispatch floor (the same graph
with every dimension shrunk, so that what is left is the cost of launching its operations).

How: a context of CONTEXT positions is prefilled once; each [B, T] step then runs on it and is
rolled back (the caches trimmed), so every round sees the same span. The trunk's parts are timed
with a barrier (`mx.eval`) around each attention and MLP block, a run of its own beside the
plain (barrier-free) forward; the parts' sum above the plain trunk is what the barriers cost.
Memory-bound or not: the weights a step reads over its time (GB/s) against the best rate the
output layer alone reaches at B1, the machine's practical read rate for one large matrix.
Medians of ROUNDS rounds after a warm-up."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, List

import mlx.core as mx
import mlx.nn as nn

from benchmarks.report import grouped_bars, machine_line, pyplot, save_figure
from mtplx.models.draft_head import output_layer

CONTEXT = 256
SHAPES = ((1, 1), (1, 2), (1, 4), (8, 1), (8, 2), (16, 1), (16, 2))
ROUNDS = 7
# the dispatch floor's model: the checkpoint's own layer count and pattern, every width tiny
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 512}


def _median_ms(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[1:])


class _Timed(nn.Module):
    """A block run behind a barrier: its input evaluated first, its output before it returns,
    the time between added to `totals[part]`."""

    def __init__(self, inner, totals: dict, part: str):
        super().__init__()
        self.inner, self.totals, self.part = inner, totals, part

    def __call__(self, *args, **kwargs):
        mx.eval([a for a in args if isinstance(a, mx.array)])
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self.totals[self.part] += time.perf_counter() - t
        return out


def _barriered_parts(model, step: Callable[[], mx.array], rounds: int) -> dict:
    """ms per step of the trunk's attention and MLP blocks, each behind a barrier."""
    layers = model.arch.text_model(model.target).layers
    totals = {"attention": 0.0, "mlp": 0.0}
    saved = [(layer.self_attn, layer.mlp) for layer in layers]
    try:
        for layer in layers:
            layer.self_attn = _Timed(layer.self_attn, totals, "attention")
            layer.mlp = _Timed(layer.mlp, totals, "mlp")
        step()                                            # warm-up, not counted
        totals.update(attention=0.0, mlp=0.0)
        for _ in range(rounds):
            step()
    finally:
        for layer, (attn, mlp) in zip(layers, saved):
            layer.self_attn, layer.mlp = attn, mlp
    return {k: 1e3 * v / rounds for k, v in totals.items()}


def _weight_bytes(module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def profile_shape(model, B: int, T: int, rounds: int = ROUNDS) -> dict:
    prompt = mx.array([[(7 * i + b) % 1000 + 10 for i in range(CONTEXT)] for b in range(B)])
    cache = model.make_cache()
    mx.eval(model.hidden(prompt, cache))
    toks = mx.array([[11 + t for t in range(T)]] * B)

    def trunk():
        h = model.hidden(toks, cache)
        mx.eval(h)
        for c in cache:
            c.trim(T)
        return h

    h = trunk()
    out = {"shape": f"[{B},{T}]", "trunk_ms": _median_ms(trunk, rounds),
           "output_layer_ms": _median_ms(lambda: mx.eval(model.logits(h)), rounds)}

    def forward():
        mx.eval(model.logits(model.hidden(toks, cache)))
        for c in cache:
            c.trim(T)

    out["forward_ms"] = _median_ms(forward, rounds)
    out.update({f"{k}_ms": v for k, v in _barriered_parts(model, trunk, rounds).items()})
    out["rest_ms"] = max(out["trunk_ms"] - out["attention_ms"] - out["mlp_ms"], 0.0)
    if model.mtp is not None:
        mtp_cache = model.make_mtp_cache()
        mx.eval(model.draft_hidden(h[:, :1], toks[:, :1], mtp_cache))

        def draft():
            mx.eval(model.draft_logits(model.draft_hidden(h[:, -1:], toks[:, -1:], mtp_cache)))
            for c in mtp_cache:
                c.trim(1)

        out["draft_ms"] = _median_ms(draft, rounds)
    return out


def _tiny_twin(model, root: Path):
    """The checkpoint's architecture with its layer count and pattern, every width TINY, random
    weights, written to `root`: its forward costs what launching the same operations does (MLX's
    and this backend's overhead)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mtplx.models.loader import load_model

    cfg = {k: v for k, v in model.config.items() if not k.startswith(("mtplx_", "mtp_"))}
    cfg.update(TINY)
    model_cls, args_cls = _get_classes(cfg)
    target = model_cls(args_cls.from_dict(cfg))
    mx.save_safetensors(str(root / "model.safetensors"), dict(tree_flatten(target.parameters())))
    (root / "config.json").write_text(json.dumps(cfg))
    for f in model.path.glob("tokenizer*"):
        shutil.copy(f, root / f.name)
    return load_model(root, load_mtp=False)


def bench_profile(model, rounds: int = ROUNDS) -> dict:
    rows = [profile_shape(model, B, T, rounds) for B, T in SHAPES]
    with tempfile.TemporaryDirectory(prefix="mtplx-twin-") as root:
        tiny = _tiny_twin(model, Path(root))
        for row, (B, T) in zip(rows, SHAPES):
            row["dispatch_floor_ms"] = profile_shape(tiny, B, T, rounds)["forward_ms"]
    trunk_bytes = sum(_weight_bytes(layer) for layer in model.arch.text_model(model.target).layers)
    head_bytes = _weight_bytes(output_layer(model.target, model.arch))
    best_read = head_bytes / (rows[0]["output_layer_ms"] / 1e3) / 1e9
    for row in rows:
        row["read_gb_s"] = (trunk_bytes + head_bytes) / (row["forward_ms"] / 1e3) / 1e9
    return {"rows": rows, "trunk_mb": trunk_bytes / 1e6, "output_layer_mb": head_bytes / 1e6,
            "best_read_gb_s": best_read, "context": CONTEXT, "rounds": rounds,
            "draft_vocab": None if model.draft_vocab is None else model.draft_vocab.size}


def render_profile(record: dict, image: str) -> str:
    lines = [f"## bench profile: where a forward's time goes ({Path(record['model']).name})", "",
             f"`{record['command']}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min.",
             machine_line(record["machine"]), "",
             f"One step of [rows, positions] on a context of {record['context']} positions, rolled back after each "
             f"round; medians of {record['rounds']} rounds. Attention and MLP: the trunk's blocks timed behind a "
             "barrier each (a run of their own); rest: the trunk's embedding, norms and residuals (trunk minus the "
             "two). Draft: the MTP head's block and its projection"
             + (f" onto its {record['draft_vocab']:,}-token draft vocabulary" if record.get("draft_vocab") else "")
             + ". Dispatch floor: the same forward of a twin with the checkpoint's layers and every width tiny. "
             f"Weights: trunk {record['trunk_mb']:.0f} MB, output layer {record['output_layer_mb']:.0f} MB; read "
             "rate: both over the forward's time, against the output layer's alone at [1,1] "
             f"({record['best_read_gb_s']:.1f} GB/s).", "",
             "| shape | forward ms | trunk ms | attention ms | MLP ms | rest ms | output layer ms | output layer share "
             "| draft ms | dispatch floor ms | read GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        draft = f"{r['draft_ms']:.1f}" if "draft_ms" in r else "-"
        lines.append(f"| {r['shape']} | {r['forward_ms']:.1f} | {r['trunk_ms']:.1f} | {r['attention_ms']:.1f} | "
                     f"{r['mlp_ms']:.1f} | {r['rest_ms']:.1f} | {r['output_layer_ms']:.1f} | "
                     f"{r['output_layer_ms'] / r['forward_ms']:.0%} | {draft} | {r['dispatch_floor_ms']:.1f} | "
                     f"{r['read_gb_s']:.1f} |")
    return "\n".join(lines + ["", f"![bench profile]({image})"]) + "\n"


def plot_profile(record: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows: List[dict] = record["rows"]
    grouped_bars(ax, [r["shape"] for r in rows],
                 {"attention": [r["attention_ms"] for r in rows], "MLP": [r["mlp_ms"] for r in rows],
                  "rest of trunk": [r["rest_ms"] for r in rows],
                  "output layer": [r["output_layer_ms"] for r in rows],
                  "draft": [r.get("draft_ms") for r in rows],
                  "dispatch floor": [r["dispatch_floor_ms"] for r in rows]},
                 "ms per step", "a forward's parts at [rows, positions]")
    save_figure(fig, path, record)
