"""Train the shipped default model: a small qwen3 with a jointly trained MTP head.

Reads top to bottom:
  1. corpus   - the Python standard library's own sources (every machine with Python has them);
                a fixed set of files is held out for evaluation.
  2. tokenizer - byte-level BPE trained with `tokenizers`, ChatML special tokens.
  3. model    - mlx-lm's qwen3 architecture (deep and narrow) + our one-layer MTP head
                (--arch qwen3_5: the Qwen3.5 hybrid layout, whose Gated DeltaNet layers train
                through the chunked form of their recurrence, `mtplx.models.gated_delta_chunked`).
  4. phase 1  - joint training: next-token loss + MTP_WEIGHT * MTP (token t+2) loss.
  5. phase 2  - self-distillation: target frozen, the MTP head learns the target's own
                next-token distribution (what it will be asked to predict when drafting).
     phase 3  - chained self-distillation on the target's own text (qwen3): the same, over text
                the target wrote itself (what serving drafts on), for every draft of a chain of
                CHAIN, each made from the head's own previous output as drafting chains them.
  6. eval     - held-out loss and greedy chained draft acceptance on the target's own greedy text.
  7. export   - HF layout (config.json, model.safetensors, tokenizer files, chat template) + card.

Deterministic for a given Python version: fixed seeds, fixed file order, fixed step counts. The
shipped model is phases 1-2 of one run and phase 3 of a later `--from` run on its output.
Usage: python scripts/train_shipped_model.py [--out mtplx/assets/mtplx-tiny-py] [--quick]
       [--from DIR]   (phase 3 only, on a checkpoint this script wrote after phase 2)
       [--arch qwen3_5 --out DIR [--steps P1 P2 P3]]   (a hybrid GDN + attention model, same recipe;
                                                     the default --arch qwen3 is the shipped model)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mtplx  # noqa: E402,F401  (loads the fast BLAS before MLX)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from mtplx.models.loader import _architectures  # noqa: E402
from mtplx.models.mtp_chain import chained_drafts  # noqa: E402
from mtplx.models.mtp_head import MTPHead  # noqa: E402
from mtplx.training.corpus import stdlib_files  # noqa: E402
from mtplx.training.distill import continue_text, fit, mlx_lm_classes, tokens_per_chain  # noqa: E402

# ---------------------------------------------------------------- settings
SEED = 1234
VOCAB = 4096
SEQ = 256
BATCH = 16
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 192, 12, 4, 2, 48, 576
PHASE1_STEPS, PHASE2_STEPS, PHASE3_STEPS = 500, 120, 240
LR1, LR2, LR3 = 3e-3, 2e-3, 1e-3
CHAIN = 3                   # drafts a chain makes: the engine's deepest (mtplx.engine.installed.DEPTHS)
GEN_SEQS, GEN_PROMPT, GEN_BATCH, GEN_TEMPERATURE = 1024, 64, 64, 0.7   # phase 3's text (own_text)
MTP_WEIGHT = 0.5
HOLDOUT_EVERY = 40          # every 40th stdlib file (sorted) is held out
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The chat template of the shipped model: Qwen3's shape (tools in the system turn, <tool_call> and
# <tool_response> blocks, <think> opened by enable_thinking), in plain-text markers
CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages and messages[0]['role'] == 'system' %"
    "}\n        {{- messages[0]['content'] + '\\n\\n' }}\n    {%- endif %}\n    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }"
    "}\n    {%- for tool in tools %}\n        {{- '\\n' + (tool | tojson) }}\n    {%- endfor %}\n    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}\n{%- endif %}\n{%- set ns = namespace(last_query=-1) %}\n{%- for message in messages %"
    "}\n    {%- if message['role'] == 'user' %}\n        {%- set ns.last_query = loop.index0 %}\n    {%- endif %"
    "}\n{%- endfor %}\n{%- for message in messages %}\n    {%- set content = message['content'] if message['content'] is string else '' %"
    "}\n    {%- if message['role'] == 'assistant' %}\n        {%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %"
    "}\n        {%- if '</think>' in content %}\n            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %"
    "}\n            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n        {%- endif %"
    "}\n        {{- '<|im_start|>assistant\\n' }}\n        {%- if reasoning.strip('\\n') and loop.index0 > ns.last_query %"
    "}\n            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}\n        {%- endif %}"
    "\n        {{- content }}\n        {%- if message['tool_calls'] %}\n            {%- for call in message['tool_calls'] %"
    "}\n                {%- if content or not loop.first %}\n                    {{- '\\n' }}\n                {%"
    "- endif %}\n                {%- set fn = call['function'] if call['function'] is defined else call %"
    "}\n                {{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}\n                {%"
    "- if fn['arguments'] is string %}\n                    {{- fn['arguments'] }}\n                {%- else %"
    "}\n                    {{- fn['arguments'] | tojson }}\n                {%- endif %}\n                {{- '}"
    "\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message['role'] == 'tool' %}\n        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %"
    "}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }"
    "}\n        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}\n            {{- '<|im_end|>\\n' }"
    "}\n        {%- endif %}\n    {%- elif not (tools and loop.first and message['role'] == 'system') %"
    "}\n        {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}\n    {%- endif %"
    "}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking %"
    "}\n        {{- '<think>\\n' }}\n    {%- endif %}\n{%- endif %}"
)


# ---------------------------------------------------------------- 1. corpus
def as_document(path: Path, text: str, index: int) -> str:
    """Half the files are wrapped as a chat turn, so the chat template leads to code."""
    if index % 2:
        return text + "<|endoftext|>"
    return (f"<|im_start|>user\nWrite the Python module {path.stem}.py<|im_end|>\n"
            f"<|im_start|>assistant\n{text}<|im_end|>\n<|endoftext|>")


# ---------------------------------------------------------------- 2. tokenizer
def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# ---------------------------------------------------------------- 3. model
ARCH = "qwen3"              # --arch; qwen3_5 trains the hybrid (GDN + attention) sibling


def model_config() -> dict:
    if ARCH == "qwen3_5":
        # Qwen3.5 layout at the same width: every 4th layer full attention, the rest Gated DeltaNet.
        text = {
            "model_type": "qwen3_5_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "max_position_embeddings": 2048, "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        }
        return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": text, "tie_word_embeddings": True, "bos_token_id": None,
                "eos_token_id": [0, 2], "torch_dtype": "float32"}
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
        "bos_token_id": None, "eos_token_id": [0, 2], "torch_dtype": "float32",
    }


def use_chunked_gdn() -> None:
    """Training and eval forwards are whole sequences with no cache: run the GDN layers' recurrence
    in its chunked form (same maths, ~10x faster forward + backward on a CPU than stepping it)."""
    from mlx_lm.models import qwen3_5

    from mtplx.models.gated_delta_chunked import gated_delta_update_chunked

    qwen3_5.gated_delta_update = gated_delta_update_chunked


class TargetWithMTP(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        model_cls, args_cls = _get_classes(config)
        args = args_cls.from_dict(config)
        arch = self._arch = _architectures()[config["model_type"]]
        self.target = model_cls(args)
        self.mtp = MTPHead(HIDDEN, arch.rms_norm_eps(args), lambda: arch.make_mtp_block(args))
        mlx_lm_classes(self.mtp)

    def __call__(self, x):
        arch = self._arch
        h = arch.hidden_states(self.target, x)                    # [B, T, H] post-norm
        logits = arch.logits(self.target, h)                       # predicts x[t+1]
        m = self.mtp(h[:, :-1], arch.embed(self.target, x[:, 1:]))  # (h_t, x_{t+1})
        mtp_logits = arch.logits(self.target, m)                   # predicts x[t+2]
        return logits, mtp_logits


# ---------------------------------------------------------------- 4-5. losses and training (phases 1-3)
def phase1_loss(model, x):
    logits, mtp_logits = model(x)
    ce = nn.losses.cross_entropy(logits[:, :-1], x[:, 1:]).mean()
    mtp_ce = nn.losses.cross_entropy(mtp_logits[:, :-1], x[:, 2:]).mean()
    return ce + MTP_WEIGHT * mtp_ce, (ce, mtp_ce)


def phase2_loss(model, x):
    """MTP head distils the frozen target's own next-token distribution at t+1."""
    logits, mtp_logits = model(x)
    teacher = mx.stop_gradient(mx.softmax(logits[:, 1:], axis=-1))
    logp = mtp_logits - mx.logsumexp(mtp_logits, axis=-1, keepdims=True)
    soft_ce = -(teacher * logp).sum(-1).mean()
    return soft_ce, (soft_ce, soft_ce)


def phase3_loss(model, x):
    """Each draft of a chain distils the frozen target's distribution where it predicts: draft k
    from start p at the target's position p + k."""
    arch, T, p0 = model._arch, x.shape[1] - CHAIN, GEN_PROMPT - 1   # p0: the first start in the target's own text
    h = mx.stop_gradient(arch.hidden_states(model.target, x))
    teacher = mx.stop_gradient(mx.softmax(arch.logits(model.target, h[:, p0 + 1:]), axis=-1))
    emb = mx.stop_gradient(arch.embed(model.target, x[:, 1:]))
    losses = []
    for k, g in enumerate(chained_drafts(model.mtp, h[:, :T], emb, CHAIN)):
        logits = arch.logits(model.target, g[:, p0:])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        losses.append(-(teacher[:, k:k + T - p0] * logp).sum(-1).mean())
    loss = sum(losses) / CHAIN
    return loss, (losses[0], losses[-1])


def batches(data: np.ndarray, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - SEQ - 1, size=BATCH)
        yield mx.array(np.stack([data[s:s + SEQ] for s in starts]))


def own_text(model, data: np.ndarray, rng: np.random.Generator, n_seqs: int) -> np.ndarray:
    """[n_seqs, SEQ] sequences: GEN_PROMPT corpus tokens (random windows of the training split)
    continued by the target itself, greedily in every other batch and sampled at GEN_TEMPERATURE
    in the rest. Serving drafts on the target's own text, where the target's habits (its loops,
    its favourite continuations) matter more than the corpus's."""
    out = []
    for b in range(0, n_seqs, GEN_BATCH):
        starts = rng.integers(0, len(data) - GEN_PROMPT, size=GEN_BATCH)
        prompts = mx.array(np.stack([data[s:s + GEN_PROMPT] for s in starts]))
        out.append(continue_text(model, prompts, SEQ - GEN_PROMPT, GEN_TEMPERATURE if (b // GEN_BATCH) % 2 else 0.0))
    return np.concatenate(out)[:n_seqs]


def sequence_batches(seqs: np.ndarray, rng: np.random.Generator):
    """Batches of BATCH whole sequences of `seqs`, drawn with replacement."""
    while True:
        yield mx.array(seqs[rng.integers(0, len(seqs), size=BATCH)])


def train(model, loss_fn, params_filter, steps, lr, source, label):
    """`steps` steps on the batches of `source` (mtplx.training.distill.fit, printing every 50)."""
    fit(model, loss_fn, params_filter, steps, lr, lambda i: next(source), label, progress=False)


# ---------------------------------------------------------------- 6. eval
def heldout_loss(model, data, n=32):
    rng = np.random.default_rng(7)
    losses = []
    for k in range(0, n, BATCH):
        x = next(batches(data, rng))
        logits, mtp_logits = model(x)
        losses.append((nn.losses.cross_entropy(logits[:, :-1], x[:, 1:]).mean().item(),
                       nn.losses.cross_entropy(mtp_logits[:, :-1], x[:, 2:]).mean().item()))
    return tuple(float(np.mean(v)) for v in zip(*losses))


def chained_acceptance(model, prompts, depth, new_tokens=128) -> list:
    """Greedy chained drafting on the target's own greedy continuation, as speculation sees it:
    per draft of a chain of `depth`, the share kept given the drafts before it kept (the first:
    the share kept)."""
    arch = model._arch
    kept = np.zeros(depth + 1)
    for p in prompts:
        seq = continue_text(model, mx.array(np.asarray(p, dtype=np.int32)[None]), new_tokens, 0.0)[0].tolist()
        x = mx.array([seq])
        h = arch.hidden_states(model.target, x)
        T = len(seq) - 1 - depth                  # starts p whose whole chain lies in seq
        outs = chained_drafts(model.mtp, h[:, :T], arch.embed(model.target, x[:, 1:]), depth)
        start = len(p) - 1  # drafts made from the last prompt position onwards
        alive = np.ones(T - start, dtype=bool)
        kept[0] += alive.sum()
        for k, g in enumerate(outs):
            drafts = np.array(mx.argmax(arch.logits(model.target, g[0, start:]), axis=-1))
            alive &= drafts == np.array(seq[start + k + 2:start + k + 2 + len(alive)])
            kept[k + 1] += alive.sum()
    return [float(kept[k + 1] / max(kept[k], 1)) for k in range(depth)]


# ---------------------------------------------------------------- 7. export
def export(model, tok, out: Path, card: dict):
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v for k, v in tree_flatten(model.target.parameters())}
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(model.mtp.parameters())})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model_config(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}, indent=2) + "\n")
    (out / "training_receipt.json").write_text(json.dumps(card, indent=2) + "\n")
    lines = [
        f"# {out.name}", "",
        f"A small {ARCH}-architecture model with a jointly trained one-layer MTP head, trained by",
        "`scripts/train_shipped_model.py` on the Python standard library's sources. It exists so that",
        "`mtplx` serves and tests with no download, with draft acceptance that means something.", "",
        "| fact | value |", "|---|---|",
    ] + [f"| {k} | {v} |" for k, v in card.items()]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def load_checkpoint(path: Path):
    """A model and tokenizer this script exported, and its card (for --from)."""
    from tokenizers import Tokenizer

    model = TargetWithMTP(json.loads((path / "config.json").read_text()))
    weights = mx.load(str(path / "model.safetensors"))
    model.target.load_weights([(k, v) for k, v in weights.items() if not k.startswith("mtp.")])
    model.mtp.load_weights([(k[len("mtp."):], v) for k, v in weights.items() if k.startswith("mtp.")])
    card = json.loads((path / "training_receipt.json").read_text())
    return model, Tokenizer.from_file(str(path / "tokenizer.json")), card


def phases_1_2(model, train_data, eval_data, p1, p2, rng, data_fact: str) -> dict:
    """Joint training, then self-distillation on the corpus; the model card so far."""
    n_target = sum(v.size for _, v in tree_flatten(model.target.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(model.mtp.parameters()))
    print(f"params: target {n_target / 1e6:.2f}M, mtp head {n_mtp / 1e6:.2f}M")
    t0 = time.perf_counter()
    train(model, phase1_loss, lambda m: m.unfreeze(), p1, LR1, batches(train_data, rng), "joint")
    ce1, mtp1 = heldout_loss(model, eval_data)
    print(f"held-out after phase 1: ce {ce1:.3f}  mtp ce {mtp1:.3f}")
    train(model, phase2_loss, lambda m: m.mtp.unfreeze(), p2, LR2, batches(train_data, rng), "distil")
    ce2, _ = heldout_loss(model, eval_data)
    return {
        "architecture": f"{ARCH}, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} kv, ffn {FFN}",
        "parameters": f"target {n_target / 1e6:.2f}M + MTP head {n_mtp / 1e6:.2f}M (fp32)",
        "tokenizer": f"byte-level BPE, {VOCAB} tokens, ChatML specials",
        "data": data_fact,
        "steps": f"phase 1 joint {p1} x {BATCH}x{SEQ}; phase 2 MTP self-distillation {p2}",
        "held-out loss": f"target ce {ce2:.3f}; MTP ce after phase 1 {mtp1:.3f}",
        "training time": f"{(time.perf_counter() - t0) / 60:.1f} min on this machine",
        "seed": SEED,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset"),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "mtplx/assets/mtplx-tiny-py"))
    ap.add_argument("--quick", action="store_true", help="a few steps, to check the script runs")
    ap.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3",
                    help="qwen3 (the shipped model) or qwen3_5 (hybrid GDN + attention, for benchmarks)")
    ap.add_argument("--steps", type=int, nargs=3, metavar=("P1", "P2", "P3"), help="override the phase step counts")
    ap.add_argument("--from", dest="start_from", type=Path, metavar="DIR",
                    help="phase 3 only, on a model this script exported after phase 2 (its tokenizer and card too)")
    a = ap.parse_args()
    global ARCH
    ARCH = a.arch
    if ARCH == "qwen3_5":
        use_chunked_gdn()
    p1, p2, p3 = (20, 10, 5) if a.quick else (PHASE1_STEPS, PHASE2_STEPS, PHASE3_STEPS)
    if a.steps:
        p1, p2, p3 = a.steps
    np_rng = np.random.default_rng(SEED)
    mx.random.seed(SEED)

    files = stdlib_files()
    held = set(range(0, len(files), HOLDOUT_EVERY))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    docs = [as_document(p, t, i) for i, (p, t) in enumerate(zip(files, texts))]
    train_docs = [d for i, d in enumerate(docs) if i not in held]
    eval_docs = [d for i, d in enumerate(docs) if i in held]
    print(f"corpus: {len(files)} stdlib files ({len(eval_docs)} held out), python {sys.version.split()[0]}")

    if a.start_from:
        model, tok, card = load_checkpoint(a.start_from)
    else:
        tok = train_tokenizer(train_docs)
    enc = lambda ds: np.concatenate([np.array(e.ids, dtype=np.int32) for e in tok.encode_batch(ds)])
    train_data, eval_data = enc(train_docs), enc(eval_docs)
    print(f"tokens: train {len(train_data):,}  eval {len(eval_data):,}")
    if not a.start_from:
        model = TargetWithMTP(model_config())
        card = phases_1_2(model, train_data, eval_data, p1, p2, np_rng,
                          f"Python {sys.version.split()[0]} stdlib, {len(train_docs)} train / {len(eval_docs)} "
                          f"held-out files, {len(train_data):,} train tokens")

    chain = 1
    if ARCH == "qwen3":       # phase 3 is the shipped recipe's (the qwen3_5 sibling stops after phase 2)
        # phase 3 from its own seeds: the same head whether it runs on after phase 2 or --from
        chain, t3 = CHAIN, time.perf_counter()
        rng3 = np.random.default_rng(SEED + 3)
        mx.random.seed(SEED + 3)
        seqs = own_text(model, train_data, rng3, GEN_SEQS if not a.quick else GEN_BATCH)
        print(f"the target's own text: {seqs.shape[0]} sequences in {(time.perf_counter() - t3) / 60:.1f} min")
        train(model, phase3_loss, lambda m: m.mtp.unfreeze(), p3, LR3, sequence_batches(seqs, rng3), "chain")
        card["steps"] += (f"; phase 3 chained self-distillation {p3} x {BATCH}x{SEQ} (chains of {CHAIN}) "
                          f"on {len(seqs)} sequences of the target's own text")
        card["phase 3 time"] = f"{(time.perf_counter() - t3) / 60:.1f} min on this machine"

    eval_ids = [np.array(tok.encode(d).ids[:64]) for d in eval_docs[:8 if not a.quick else 2]]
    acc = chained_acceptance(model, eval_ids, chain, new_tokens=128 if not a.quick else 16)
    card[f"greedy chained acceptance (held-out; draft k given drafts < k kept, k = 1..{chain})"] = \
        ", ".join(f"{x:.3f}" for x in acc) + f" ({tokens_per_chain(acc):.2f} tokens a row-cycle at depth {chain})"
    print(json.dumps(card, indent=2))
    export(model, tok, Path(a.out), card)


if __name__ == "__main__":
    main()
