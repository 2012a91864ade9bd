"""`mtplx train-head MODEL_DIR`: train an MTP head for a checkpoint that has none.

Reads top to bottom:
  1. prompts   - the default corpus (corpus.py: the Python standard library's sources and
                 docstrings, and the chat and English prompts of prompts.txt), or the user's own;
                 a held-out split for the report.
  2. own text  - the target continues every prompt itself, in batches (own_text.py): greedy
                 and sampled rows, keeping its hidden state and logsumexp at every position.
                 Serving drafts on the target's own text, so that is what the head learns.
  3. draft vocabulary - optional: the K tokens the target writes most (FR-Spec / EAGLE-3), chosen
                 from the coverage of its held-out text and the measured cost of projecting onto
                 K rows (draft_head.py); the verify always uses the whole vocabulary.
  4. head      - one decoder block of the target's own kind, freshly initialized, behind the fc
                 that joins (embedding of token t+1, hidden at t).
  5. training  - self-distillation: the head's distribution against the target's own at the
                 position it predicts, over the draft vocabulary; phase 1 the first draft
                 alone, phase 2 every draft of a chain of DEPTH, each made from the head's own
                 previous output as drafting chains them (mtplx.models.mtp_chain). Resumable.
  6. report    - held-out acceptance per draft position: greedy (the draft is the target's
                 greedy token, given the drafts before it were) and at t0.6 (the chance the
                 target keeps a draft drawn from the head, sum_x min(p(x), q(x)), along the chain).
  7. export    - the head beside the checkpoint (mtp_head.safetensors and config.json's
                 `mtplx_mtp_head`); the target's weights untouched, checked by their hashes; the
                 reloaded model's greedy MTP output checked against its greedy AR output.

Work files (the target's text, checkpoints) go to MODEL_DIR.train-head/ (--work-dir); run the
same command again after an interruption and it continues. Deterministic for a seed, a machine's
BLAS and a Python version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------- settings (sized for a 2-core CPU)
SEED = 0
TRAIN_PROMPTS, HELDOUT_PROMPTS = 768, 64
MIX = {"chat": 0.4, "text": 0.3, "code": 0.3}     # shares of the default corpus's kinds
NEW_TOKENS = 128             # tokens the target writes per prompt
GEN_BATCH = 64               # rows the target writes at once
TRAIN_TEMPERATURES = (0.0, 0.6, 0.0, 1.0)          # row r of the train split at [r % 4]: half greedy
HELDOUT_TEMPERATURES = (0.0, 0.6)                   # the report's two settings
DEPTH = 3                    # drafts of a chain: the engine's deepest (mtplx.engine.installed.DEPTHS)
HISTORY = 8                  # prompt positions a training window keeps before the target's text
BATCH = 16                   # windows a step
STEPS = (350, 150)           # phase 1 (first draft), phase 2 (chains of DEPTH)
LR = (2e-3, 1e-3)
DRAFT_VOCAB_CANDIDATES = (8192, 16384, 32768, 65536)
ASSUMED_ACCEPTANCE = 0.8     # the head's per-draft acceptance where the target's token is in the draft vocabulary
EVAL_TEMPERATURE = 0.6
CHECKPOINT_EVERY_S = 120.0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=5.0, dynamic_ncols=True)


# ---------------------------------------------------------------- 1. prompts
def prompts(tokenizer, a) -> tuple:
    from .corpus import build_prompts

    mix = dict(MIX)
    if a.corpus:           # the user's own: all of it, or half beside the default corpus
        mix = {"user": 1.0} if a.corpus_only else dict({k: v / 2 for k, v in MIX.items()}, user=0.5)
    train = build_prompts(tokenizer, "train", a.prompts, a.seed, mix, a.corpus)
    heldout = build_prompts(tokenizer, "heldout", a.heldout, a.seed + 1, mix, a.corpus)
    return train, heldout


# ---------------------------------------------------------------- 2. the target's own text
def own_text(model, train, heldout, work: Path, a) -> tuple:
    from .own_text import write_shards

    stop = frozenset(model.eos_token_ids)
    bar = _bar(len(train) + len(heldout), "the target's own text", "prompt")
    t0 = time.perf_counter()
    train_paths = write_shards(model, train, work / "own_text", "train", a.gen_batch, a.new_tokens,
                               TRAIN_TEMPERATURES, a.seed, stop, bar.update)
    heldout_paths = write_shards(model, heldout, work / "own_text", "heldout", a.gen_batch, a.new_tokens,
                                 HELDOUT_TEMPERATURES, a.seed + 1, stop, bar.update)
    bar.close()
    return train_paths, heldout_paths, time.perf_counter() - t0


def load_shards(paths) -> list:
    from .own_text import Shard

    return [Shard.load(p) for p in paths]


def written_tokens(shards) -> np.ndarray:
    """Every token the target wrote (its text up to each row's end)."""
    return np.concatenate([s.tokens[b, s.prompt_end:s.end[b]] for s in shards for b in range(len(s.end))])


# ---------------------------------------------------------------- 3. draft vocabulary
def frequency_order(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids by how often the target wrote them, most first (ties: the lower id)."""
    counts = np.bincount(tokens, minlength=vocab)
    return np.lexsort((np.arange(vocab), -counts))


def coverage(order: np.ndarray, tokens: np.ndarray, k: int) -> float:
    """The share of `tokens` among the first k of `order`."""
    inside = np.zeros(len(order), dtype=bool)
    inside[order[:k]] = True
    return float(inside[tokens].mean())


def projection_cost_s(model, k: int, width: int = 8, reps: int = 20) -> float:
    """Seconds to project `width` rows of hidden state onto k output rows (k = the whole
    vocabulary: the target's own output layer), median of `reps`."""
    import mlx.core as mx

    from mtplx.models.draft_head import build_draft_vocab

    h = mx.random.normal((width, 1, model.arch.hidden_size(model.target.args)), key=mx.random.key(1))
    if k >= model.vocab_size:
        fn = model.logits
    else:
        fn = build_draft_vocab(model.target, model.arch, list(range(k)), model.vocab_size).logits
    mx.eval(fn(h))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(mx.argmax(fn(h), axis=-1))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def choose_draft_vocab(model, order, heldout_tokens, depth: int, choice: str) -> tuple:
    """(K or None for the whole vocabulary, the measurements). "auto": the K of the candidates
    whose chain is expected to yield the most tokens a second at B8: acceptance ASSUMED_ACCEPTANCE
    times the coverage of the target's held-out text, over the cost of a verify at [8, 1 + depth]
    and `depth` projections onto K rows (each measured here)."""
    import mlx.core as mx

    V = model.vocab_size
    if choice == "full":
        return None, {}
    if choice != "auto":
        return min(int(choice), V), {"coverage_heldout": coverage(order, heldout_tokens, int(choice))}
    x = mx.zeros((8, 1 + depth), dtype=mx.int32)
    verify = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(model.logits(model.hidden(x, model.make_cache())))
        verify.append(time.perf_counter() - t)
    verify_s = float(np.median(verify))
    table = {}
    for k in [c for c in DRAFT_VOCAB_CANDIDATES if c < V] + [V]:
        cov = coverage(order, heldout_tokens, k) if k < V else 1.0
        a = ASSUMED_ACCEPTANCE * cov
        tokens = 1 + sum(a ** j for j in range(1, depth + 1))
        proj = projection_cost_s(model, k)
        table[k] = {"coverage_heldout": round(cov, 4), "projection_ms_b8": round(proj * 1e3, 2),
                    "expected_tokens_a_cycle": round(tokens, 3),
                    "expected_tokens_per_s_b8": round(8 * tokens / (verify_s + depth * proj), 1)}
        _say(f"  draft vocabulary {k:>7}: held-out coverage {cov:.4f}, projection {proj * 1e3:6.2f} ms at B8, "
             f"~{table[k]['expected_tokens_per_s_b8']:.0f} tok/s expected at B8")
    best = max(table, key=lambda k: table[k]["expected_tokens_per_s_b8"])
    return (None if best == V else best), {"verify_ms_b8": round(verify_s * 1e3, 1), "candidates": table}


# ---------------------------------------------------------------- 4. the head
def new_head(model):
    """A head of the target's own block, freshly initialized, every norm of the block at scale 1
    (Gemma's norms scale by 1 + w, which mlx-lm starts at w = 1: scale 2), its output norm at the
    scale of the target's final norm, so that its first outputs live where the target's hidden
    states do. Why not a copy of the target's last global layer (its input is the fc's, not that
    layer's): on Gemma 3 270M that start kept fewer drafts after the same training (held-out
    greedy first-draft acceptance 0.19 against 0.25 after 60 steps of phase 1)."""
    import mlx.core as mx

    from mtplx.models.mtp_head import MTPHead

    from .distill import mlx_lm_classes

    arch, args = model.arch, model.target.args
    H = arch.hidden_size(args)
    head = MTPHead(H, arch.rms_norm_eps(args), lambda: arch.make_mtp_block(args))
    mlx_lm_classes(head)
    for name, norm in head.layers[0].named_modules():
        if name.endswith("norm"):       # rms_norm(ones) is the scale
            norm.weight = norm.weight - (norm(mx.ones((1, norm.weight.shape[0]))).reshape(-1) - 1)
    final_norm = arch.text_model(model.target).norm
    head.norm.weight = final_norm(mx.ones((1, H))).reshape(-1) * 1.0
    mx.eval(head.parameters())
    return head


# ---------------------------------------------------------------- 5. losses and training
class Windows:
    """The train split's rows as windows of HISTORY prompt positions and the target's text,
    all of one length: hidden states, tokens, logsumexps and where a teacher is valid (a position
    of the target's text whose next token was served: before the row's end)."""

    def __init__(self, shards, history: int):
        hs, toks, lses, valid = [], [], [], []
        for s in shards:
            lo, hi = s.prompt_end - history, s.tokens.shape[1]
            hs.append(s.hidden[:, lo:hi])
            toks.append(s.tokens[:, lo:hi])
            lse = s.lse[:, lo:hi].copy()
            lses.append(np.where(np.isnan(lse), np.inf, lse))     # no teacher there: exp(x - inf) = 0
            j = np.arange(lo, hi)[None]
            valid.append((j >= s.prompt_end) & (j <= s.end[:, None] - 2))
        width = min(h.shape[1] for h in hs)
        self.hidden = np.concatenate([h[:, :width] for h in hs])
        self.tokens = np.concatenate([t[:, :width] for t in toks])
        self.lse = np.concatenate([x[:, :width] for x in lses])
        self.valid = np.concatenate([v[:, :width] for v in valid]).astype(np.float32)

    def __len__(self):
        return len(self.tokens)

    def batch(self, seed: int, step: int, size: int) -> tuple:
        import mlx.core as mx

        rows = np.random.default_rng([seed, step]).integers(0, len(self), size=size)
        return (mx.array(self.hidden[rows].astype(np.float32)), mx.array(self.tokens[rows]),
                mx.array(self.lse[rows]), mx.array(self.valid[rows]))


def chain_loss(project, embed, depth: int, history: int):
    """The loss of a chain of `depth` drafts on a window batch: per draft, the soft cross-entropy
    of the head's distribution (over the draft vocabulary, `project`) against the target's at the
    position it predicts, restricted to the same tokens, exactly (the logsumexp is the whole
    vocabulary's), from the last prompt position on; the mean over the chain's drafts."""
    import mlx.core as mx

    from mtplx.models.mtp_chain import chained_drafts

    from .distill import soft_cross_entropy

    p0 = history - 1

    def loss(head, batch):
        hidden, tokens, lse, valid = batch
        T = hidden.shape[1] - depth
        teacher = mx.stop_gradient(mx.exp(project(hidden[:, p0 + 1:]) - lse[:, p0 + 1:, None]))
        outs = chained_drafts(head, hidden[:, :T], mx.stop_gradient(embed(tokens[:, 1:])), depth)
        losses = [soft_cross_entropy(teacher[:, k:k + T - p0], project(g[:, p0:]), valid[:, p0 + 1 + k:T + 1 + k])
                  for k, g in enumerate(outs)]
        return sum(losses) / depth, (losses[0], losses[-1])

    return loss


def train(head, project, embed, windows: Windows, work: Path, a) -> dict:
    from .distill import Checkpoint, fit

    out = {}
    for phase, (depth, steps, lr) in enumerate(((1, a.steps[0], LR[0]), (a.depth, a.steps[1], LR[1])), start=1):
        if steps <= 0:
            continue
        t0 = time.perf_counter()
        res = fit(head, chain_loss(project, embed, depth, HISTORY), lambda m: m.unfreeze(), steps, lr,
                  lambda i: windows.batch(a.seed * 1000 + phase, i, a.batch),
                  f"phase {phase} (chains of {depth})", Checkpoint(work / f"phase{phase}", CHECKPOINT_EVERY_S))
        out[f"phase {phase}"] = {"depth": depth, "steps": steps, "batch": f"{a.batch} x {windows.hidden.shape[1]}",
                                 "loss": round(res.get("loss", float("nan")), 4),
                                 "minutes (this run)": round((time.perf_counter() - t0) / 60, 1)}
    return out


# ---------------------------------------------------------------- 6. report
def acceptance(head, model, project, ids, shards, depth: int, temperature: float) -> list:
    """Per draft k of a chain of `depth`: on the held-out rows written at `temperature`, the share
    of drafts the target keeps given the drafts before it were kept. Greedy: the head's argmax is
    the target's next token. Sampled: sum_x min(p(x), q(x)) at `temperature` (p the target's, q
    the head's, zero outside the draft vocabulary), each start's draft k weighted by the chance
    its chain got there. `project`: the head's logits over the draft vocabulary `ids` (None: the
    whole vocabulary)."""
    import mlx.core as mx

    from mtplx.models.mtp_chain import chained_drafts

    reached = np.zeros(depth + 1)
    kept = np.zeros(depth)
    for s in shards:
        for b in np.flatnonzero(s.temperature == temperature):
            lo, hi = s.start[b], int(s.end[b])
            x = s.tokens[b, lo:hi]
            h = mx.array(s.hidden[b, lo:hi].astype(np.float32))[None]
            T = len(x) - 1 - depth
            p0 = s.prompt_end - lo - 1                   # the last prompt position: the first start
            if T <= p0:
                continue
            outs = chained_drafts(head, h[:, :T], model.embed(mx.array(x[None, 1:])), depth)
            weight = np.ones(T - p0)
            for k, g in enumerate(outs):
                q_logits = project(g[0, p0:])                       # [starts, K] or [starts, V]
                target_next = x[p0 + k + 2:T + k + 2]               # the text's token each draft predicts
                if temperature == 0:
                    draft = np.array(mx.argmax(q_logits, axis=-1))
                    draft = ids[draft] if ids is not None else draft
                    ok = (draft == target_next).astype(np.float64)
                else:
                    p = mx.softmax(model.logits(h[0, p0 + k + 1:T + k + 1]).astype(mx.float32) / temperature, axis=-1)
                    q = mx.softmax(q_logits.astype(mx.float32) / temperature, axis=-1)
                    if ids is not None:
                        p = p[:, mx.array(ids)]
                    ok = np.array(mx.minimum(p, q).sum(-1)).astype(np.float64)
                reached[k] += weight.sum()
                kept[k] += (weight * ok).sum()
                weight = weight * ok
    return [round(float(kept[k] / max(reached[k], 1e-9)), 4) for k in range(depth)]


# ---------------------------------------------------------------- 7. export
def weights_digest(model_dir: Path) -> str:
    """sha256 over the checkpoint's target weight files (what train-head never writes)."""
    from mtplx.models.registry import files_sha256

    return files_sha256(sorted(model_dir.glob("model*.safetensors")))


def greedy_check(model_dir: Path, heldout, depth: int, tokens: int = 48, n: int = 2) -> dict:
    """The checkpoint reloaded with its new head: greedy MTP output equals greedy AR output on
    held-out prompts (the target is the one that decides every token)."""
    import mtplx
    from mtplx.engine.decode import generate_ar, generate_mtpk
    from mtplx.sampling import GREEDY

    model = mtplx.load_model(model_dir)
    assert model.mtp is not None, model.mtp_disabled_reason
    accepted = drafted = 0
    for p in heldout[:n]:
        ar = generate_ar(model, list(p.ids), tokens, GREEDY).tokens
        r = generate_mtpk(model, list(p.ids), tokens, GREEDY, depth=depth)
        if r.tokens != ar:
            raise RuntimeError(f"greedy MTP output differs from greedy AR on {p.source}: the head is not "
                               "wired exactly; nothing should ever make this happen")
        accepted += r.stats["accepted_drafts"]
        drafted += r.stats["accepted_drafts"] + r.stats["rejected_drafts"]
    return {"prompts": n, "tokens": tokens, "identical": True, "drafts_kept": round(accepted / max(drafted, 1), 3)}


def draft_projection(model, order, heldout_shards, a) -> tuple:
    """(the draft ids or None, the head's logits over them, the measurements behind the choice)."""
    from mtplx.models.draft_head import build_draft_vocab

    K, facts = choose_draft_vocab(model, order, written_tokens(heldout_shards), a.depth, a.draft_vocab)
    _say(f"draft vocabulary: {'the whole vocabulary' if K is None else f'{K:,} tokens'}")
    if K is None:
        return None, model.logits, facts
    ids = np.sort(order[:K])
    return ids, build_draft_vocab(model.target, model.arch, ids.tolist(), model.vocab_size).reduced_logits, facts


def export(model_dir: Path, head, ids, meta: dict, digest: str, heldout_prompts, a) -> dict:
    """Write the head and its entry, check the target's weights and its greedy output."""
    from mtplx.models.draft_head import CONFIG_KEY, save_head, update_entry

    marker = model_dir / "mtplx_model.json"         # `mtplx models add`'s record of what it converted
    meta["trained_on"] = {"model": model_dir.name, "weights_sha256": digest,
                          "source_sha256": json.loads(marker.read_text()).get("source_sha256")
                          if marker.is_file() else None}
    quantize = {"bits": a.quantize, "group_size": 64} if a.quantize else None
    save_head(model_dir, head, None if ids is None else ids.tolist(), meta, quantize)
    if weights_digest(model_dir) != digest:
        raise RuntimeError("the target's weight files changed during train-head")
    meta["greedy_check"] = greedy_check(model_dir, heldout_prompts, a.depth)
    update_entry(model_dir, {"greedy_check": meta["greedy_check"]})
    _say(f"wrote {model_dir / 'mtp_head.safetensors'} and config.json's {CONFIG_KEY}; "
         f"greedy MTP == greedy AR on held-out prompts: {meta['greedy_check']}")
    return meta


def main(a) -> dict:
    import mlx.core as mx

    import mtplx
    from mtplx.models.draft_head import CONFIG_KEY
    from mtplx.models.registry import check_installed

    from .distill import mlx_lm_classes

    t_start = time.perf_counter()
    model_dir = Path(check_installed(a.model_dir)).expanduser().resolve()    # a path, or an installed model's name
    work = Path(a.work_dir) if a.work_dir else model_dir.with_name(model_dir.name + ".train-head")
    work.mkdir(parents=True, exist_ok=True)
    if json.loads((model_dir / "config.json").read_text()).get(CONFIG_KEY) and not a.force:
        raise SystemExit(f"{model_dir} already has a head from train-head ({CONFIG_KEY} in config.json); "
                         "--force trains a new one")
    digest = weights_digest(model_dir)
    model = mtplx.load_model(model_dir, load_mtp=False)
    mlx_lm_classes(model.target)          # mlx-lm's own forward (batched, left-padded rows; gradients)
    mx.random.seed(a.seed)
    _say(f"train-head: {model_dir.name} ({model.config['model_type']}, vocabulary {model.vocab_size:,}); "
         f"work files in {work}")

    # 1-2. prompts and the target's own text
    train_prompts, heldout_prompts = prompts(model.tokenizer, a)
    _say(f"prompts: {len(train_prompts)} to train on, {len(heldout_prompts)} held out")
    train_paths, heldout_paths, gen_s = own_text(model, train_prompts, heldout_prompts, work, a)
    train_shards, heldout_shards = load_shards(train_paths), load_shards(heldout_paths)
    written = written_tokens(train_shards)
    _say(f"the target's own text: {len(written):,} tokens to train on ({gen_s / 60:.1f} min this run)")

    # 3. draft vocabulary
    ids, project, vocab_facts = draft_projection(model, frequency_order(written, model.vocab_size),
                                                 heldout_shards, a)

    # 4-5. the head, trained
    head = new_head(model)
    facts = train(head, project, model.embed, Windows(train_shards, HISTORY), work, a)

    # 6. report
    head.eval()
    report = {("greedy" if t == 0 else f"t{t}"): acceptance(head, model, project, ids, heldout_shards, a.depth, t)
              for t in HELDOUT_TEMPERATURES}
    _say(f"held-out acceptance per draft position (draft k given drafts < k kept): {json.dumps(report)}")

    # 7. export
    meta = {"trained_by": "mtplx train-head", "depth": a.depth, "seed": a.seed,
            "corpus": "default" if not a.corpus else ("user" if a.corpus_only else "default + user"),
            "own_text_tokens": int(len(written)), "heldout_acceptance": report,
            "draft_vocab": vocab_facts or None, "training": facts,
            "minutes": round((time.perf_counter() - t_start) / 60, 1)}
    return export(model_dir, head, ids, meta, digest, heldout_prompts, a)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="an HF-layout checkpoint directory without an MTP head")
    p.add_argument("--work-dir", default=None, help="the target's text and checkpoints (MODEL_DIR.train-head)")
    p.add_argument("--corpus", type=Path, default=None,
                   help="your own prompts: a text file (one a line), .jsonl (prompt/text/messages) or a directory")
    p.add_argument("--corpus-only", action="store_true", help="only --corpus, not the default corpus beside it")
    p.add_argument("--draft-vocab", default="auto",
                   help="auto (chosen by measurement), full (the whole vocabulary) or a number of tokens")
    p.add_argument("--depth", type=int, default=DEPTH, choices=(1, 2, 3), help="drafts a chain is trained for")
    p.add_argument("--prompts", type=int, default=TRAIN_PROMPTS, help="prompts the target continues to train on")
    p.add_argument("--heldout", type=int, default=HELDOUT_PROMPTS, help="held-out prompts for the report")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens the target writes a prompt")
    p.add_argument("--gen-batch", type=int, default=GEN_BATCH, help="rows the target writes at once")
    p.add_argument("--steps", type=int, nargs=2, default=list(STEPS), metavar=("P1", "P2"),
                   help="phase 1 (first draft) and phase 2 (chains) steps")
    p.add_argument("--batch", type=int, default=BATCH, help="windows a training step")
    p.add_argument("--quantize", type=int, choices=(4, 8), default=None, help="store the head's layers in 4 or 8 bits")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--force", action="store_true", help="replace a head train-head wrote before (its work files are "
                                                        "reused: remove the work directory to start over)")
