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
  6. eval     - held-out loss and greedy depth-1 draft acceptance on the target's own greedy text.
  7. export   - HF layout (config.json, model.safetensors, tokenizer files, chat template) + card.

Deterministic for a given Python version: fixed seeds, fixed file order, fixed step counts.
Usage: python scripts/train_shipped_model.py [--out mtplx/assets/mtplx-tiny-py] [--quick]
       [--arch qwen3_5 --out DIR [--steps P1 P2]]   (a hybrid GDN + attention model, same recipe;
                                                     the default --arch qwen3 is the shipped model)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mtplx  # noqa: E402,F401  (loads the fast BLAS before MLX)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

from mtplx.models.loader import _architectures  # noqa: E402
from mtplx.models.mtp_head import MTPHead  # noqa: E402

# ---------------------------------------------------------------- settings
SEED = 1234
VOCAB = 4096
SEQ = 256
BATCH = 16
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 192, 12, 4, 2, 48, 576
PHASE1_STEPS, PHASE2_STEPS = 500, 120
LR1, LR2 = 3e-3, 2e-3
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
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = [p for p in sorted(root.rglob("*.py")) if not any(s in p.relative_to(root).parts for s in skip)]
    return [p for p in files if 200 < p.stat().st_size < 400_000]


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

    def __call__(self, x):
        arch = self._arch
        h = arch.hidden_states(self.target, x)                    # [B, T, H] post-norm
        logits = arch.logits(self.target, h)                       # predicts x[t+1]
        m = self.mtp(h[:, :-1], arch.embed(self.target, x[:, 1:]))  # (h_t, x_{t+1})
        mtp_logits = arch.logits(self.target, m)                   # predicts x[t+2]
        return logits, mtp_logits


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


def batches(data: np.ndarray, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - SEQ - 1, size=BATCH)
        yield mx.array(np.stack([data[s:s + SEQ] for s in starts]))


def train(model, loss_fn, params_filter, steps, lr, data, rng, label):
    warm = min(50, steps // 5)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / 20, lr, warm), optim.cosine_decay(lr, steps - warm, lr / 20)], [warm])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    model.freeze()
    params_filter(model)
    state = [model.state, opt.state]
    value_and_grad = nn.value_and_grad(model, lambda m, x: loss_fn(m, x))

    def step(x):
        (loss, parts), grads = value_and_grad(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, parts

    step = mx.compile(step, inputs=state, outputs=state)
    t0, seen = time.perf_counter(), 0
    for i, x in zip(range(steps), batches(data, rng)):
        loss, (a, b) = step(x)
        mx.eval(state, loss)
        seen += x.size
        if i % 50 == 0 or i == steps - 1:
            dt = time.perf_counter() - t0
            print(f"[{label}] step {i:5d}/{steps} loss {loss.item():.3f} ce {a.item():.3f} "
                  f"mtp {b.item():.3f}  {seen / dt:,.0f} tok/s  {dt / 60:.1f} min", flush=True)
    model.unfreeze()


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


def greedy_acceptance(model, prompts, new_tokens=128):
    """Depth-1 acceptance on the target's own greedy continuation, as speculation sees it."""
    hits = total = 0
    for p in prompts:
        seq = [int(t) for t in p]
        for _ in range(new_tokens):  # plain greedy with a full forward: slow but obviously right
            logits, _ = model(mx.array([seq]))
            seq.append(int(mx.argmax(logits[0, -1]).item()))
        x = mx.array([seq])
        logits, mtp_logits = model(x)
        start = len(p) - 1  # drafts made from the last prompt position onwards
        tgt = np.array(seq[start + 2:])
        drafts = np.array(mx.argmax(mtp_logits[0, start:len(seq) - 2], axis=-1))
        hits += int((drafts == tgt).sum())
        total += len(tgt)
    return hits / max(total, 1)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "mtplx/assets/mtplx-tiny-py"))
    ap.add_argument("--quick", action="store_true", help="a few steps, to check the script runs")
    ap.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3",
                    help="qwen3 (the shipped model) or qwen3_5 (hybrid GDN + attention, for benchmarks)")
    ap.add_argument("--steps", type=int, nargs=2, metavar=("P1", "P2"), help="override the phase step counts")
    a = ap.parse_args()
    global ARCH
    ARCH = a.arch
    if ARCH == "qwen3_5":
        use_chunked_gdn()
    p1, p2 = (20, 10) if a.quick else (PHASE1_STEPS, PHASE2_STEPS)
    if a.steps:
        p1, p2 = a.steps
    t_start = time.perf_counter()
    np_rng = np.random.default_rng(SEED)
    mx.random.seed(SEED)

    files = stdlib_files()
    held = set(range(0, len(files), HOLDOUT_EVERY))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    docs = [as_document(p, t, i) for i, (p, t) in enumerate(zip(files, texts))]
    train_docs = [d for i, d in enumerate(docs) if i not in held]
    eval_docs = [d for i, d in enumerate(docs) if i in held]
    print(f"corpus: {len(files)} stdlib files ({len(eval_docs)} held out), python {sys.version.split()[0]}")

    tok = train_tokenizer(train_docs)
    enc = lambda ds: np.concatenate([np.array(e.ids, dtype=np.int32) for e in tok.encode_batch(ds)])
    train_data, eval_data = enc(train_docs), enc(eval_docs)
    print(f"tokens: train {len(train_data):,}  eval {len(eval_data):,}")

    model = TargetWithMTP(model_config())
    n_target = sum(v.size for _, v in tree_flatten(model.target.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(model.mtp.parameters()))
    print(f"params: target {n_target / 1e6:.2f}M, mtp head {n_mtp / 1e6:.2f}M")

    train(model, phase1_loss, lambda m: m.unfreeze(), p1, LR1, train_data, np_rng, "joint")
    ce1, mtp1 = heldout_loss(model, eval_data)
    print(f"held-out after phase 1: ce {ce1:.3f}  mtp ce {mtp1:.3f}")
    train(model, phase2_loss, lambda m: m.mtp.unfreeze(), p2, LR2, train_data, np_rng, "distil")
    ce2, mtp2 = heldout_loss(model, eval_data)

    eval_ids = [np.array(tok.encode(d).ids[:64]) for d in eval_docs[:8 if not a.quick else 2]]
    acc = greedy_acceptance(model, eval_ids, new_tokens=128 if not a.quick else 16)
    minutes = (time.perf_counter() - t_start) / 60
    card = {
        "architecture": f"{ARCH}, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} kv, ffn {FFN}",
        "parameters": f"target {n_target / 1e6:.2f}M + MTP head {n_mtp / 1e6:.2f}M (fp32)",
        "tokenizer": f"byte-level BPE, {VOCAB} tokens, ChatML specials",
        "data": f"Python {sys.version.split()[0]} stdlib, {len(files) - len(held)} train / {len(held)} held-out files, "
                f"{len(train_data):,} train tokens",
        "steps": f"phase 1 joint {p1} x {BATCH}x{SEQ}; phase 2 MTP self-distillation {p2}",
        "held-out loss": f"target ce {ce2:.3f}; MTP ce after phase 1 {mtp1:.3f}",
        "greedy depth-1 acceptance (held-out)": f"{acc:.3f}",
        "training time": f"{minutes:.1f} min on this machine",
        "seed": SEED,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset"),
    }
    print(json.dumps(card, indent=2))
    export(model, tok, Path(a.out), card)


if __name__ == "__main__":
    main()
