"""Checkpoints of real shape, written by code (no download): for tests and for benchmarking.

Real checkpoints are bf16 or 4-bit with bf16 activations and 150k-250k-token vocabularies
(Qwen3: 151,936; Qwen3.5/3.6: 248,320). `write_checkpoint` writes one such checkpoint, small in
layers and hidden size so it loads and decodes quickly on a CPU, large where real ones are large:
the vocabulary (embedding, `lm_head`, every logits row the sampler sees), the dtype, the
quantization (4-bit affine body, 8-bit routers and embeddings, a 4-bit group-32 MTP head as
MTPLX ships it), tied or untied embeddings.

The MTP head is one of:
  "agree"  - made to agree often (as `tests/test_hybrid.py` does): every residual branch's output
             projection is scaled by 0.1, which makes the target nearly a bigram model, and the
             head's `fc` passes the embedding half through, so it predicts the target's next-next
             token most of the time but not always;
  "never"  - a head that never agrees: its `fc` is zero, so its logits are all zero and its greedy
             draft is always token 0, which the target never picks (its logit row is zero too,
             below the maximum of the others);
  "random" - the head as initialised (a fresh conversion could look like this; it rarely agrees);
  "none"   - no `mtp.*` weights at all (the checkpoint loads AR-only).

The tokenizer is the shipped model's, its vocabulary extended to the model's size with tokens
`<N>` (never produced by encoding; they decode to their text), so every id decodes.

    python -m mtplx.synthetic DIR            # writes the standard set (see SUITE) under DIR
    mtplx bench lane --model DIR/qwen3_5_moe-bf16-v248320
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

QWEN3_VOCAB, QWEN35_VOCAB = 151_936, 248_320
HEADS = ("agree", "never", "random", "none")
BRANCH_OUT = ("o_proj", "out_proj", "down_proj")
ROUTERS = ("mlp.gate", "shared_expert_gate")
# Output rows scaled up so that the next-token distributions are peaked as a trained model's are
# (a few tokens carry most of the mass) rather than nearly flat over the vocabulary.
LOGIT_SCALE = 4.0

# The standard set: name -> write_checkpoint keyword arguments.
SUITE = {
    "qwen3-bf16-v151936-tied": dict(arch="qwen3", vocab=QWEN3_VOCAB, tied=True),
    "qwen3-bf16-v151936-never": dict(arch="qwen3", vocab=QWEN3_VOCAB, head="never"),
    "qwen3-q4-v151936": dict(arch="qwen3", vocab=QWEN3_VOCAB, quantized=True),
    "qwen3_5_moe-bf16-v248320": dict(arch="qwen3_5_moe", vocab=QWEN35_VOCAB),
    "qwen3_5_moe-q4-v248320-tied": dict(arch="qwen3_5_moe", vocab=QWEN35_VOCAB, quantized=True, tied=True),
    "qwen3_5_moe-bf16-v248320-nohead": dict(arch="qwen3_5_moe", vocab=QWEN35_VOCAB, head="none"),
}


def config(arch: str, vocab: int, tied: bool, hidden: int = 64, layers: int = 4) -> dict:
    """An HF-style config.json of the given architecture, at a small size."""
    common = dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                  vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=tied,
                  mtp_num_hidden_layers=1)
    if arch == "qwen3":
        return dict(common, model_type="qwen3", rope_theta=10000.0, eos_token_id=[0, 2], torch_dtype="bfloat16")
    if arch not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"arch={arch!r} is not one of qwen3, qwen3_5, qwen3_5_moe")
    text = dict(common, model_type=arch + "_text", linear_num_value_heads=2, linear_num_key_heads=1,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                full_attention_interval=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if arch == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                    shared_expert_intermediate_size=hidden, moe_intermediate_size=hidden)
    # HF nests the language model's config under text_config (the checkpoints are multimodal)
    return {"model_type": arch, "text_config": text, "tie_word_embeddings": tied, "eos_token_id": [0, 2],
            "torch_dtype": "bfloat16"}


def _modules(cfg: dict):
    """A randomly initialised mlx-lm target and an MTP head for `cfg`."""
    from mlx_lm.utils import _get_classes

    from .models.loader import _architectures
    from .models.mtp_head import MTPHead

    model_cls, args_cls = _get_classes(cfg)
    target = model_cls(args_cls.from_dict(cfg))
    arch = _architectures()[cfg["model_type"]]
    head = MTPHead(arch.hidden_size(target.args), arch.rms_norm_eps(target.args),
                   lambda: arch.make_mtp_block(target.args))
    return target, head, arch


def _quantize(module: nn.Module, group_size: int, prefix: str = "") -> dict:
    """4-bit affine, 8-bit routers and embeddings (as mlx-lm's mixed recipes do); returns the
    config entries of the layers whose width differs from the default."""
    wide = {}

    def predicate(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if path.endswith(ROUTERS) or path.endswith(("embed_tokens", "lm_head")):
            wide[prefix + path] = {"group_size": group_size, "bits": 8}
            return {"group_size": group_size, "bits": 8}
        return {"group_size": group_size, "bits": 4}

    nn.quantize(module, class_predicate=predicate)
    return wide


def write_tokenizer(dst: Path, vocab: int) -> None:
    """The shipped tokenizer with its vocabulary extended to `vocab` ids (`<N>` tokens)."""
    from .models.loader import SHIPPED_MODEL

    tok = json.loads((SHIPPED_MODEL / "tokenizer.json").read_text())
    table = tok["model"]["vocab"]
    n = len(table)
    for i in range(n, vocab):
        table[f"<{i}>"] = i
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
    tcfg["model_max_length"] = 4096
    (dst / "tokenizer_config.json").write_text(json.dumps(tcfg))


def _shape_weights(target, mtp, arch_mod, head: str, tied: bool, hidden: int) -> None:
    """Random weights made decisive (scaled logits) and the head made to agree with the target,
    never agree, or stay random (`head`)."""
    for mod in (target, mtp):
        if head in ("agree", "never"):
            small = [(k, v * 0.1) for k, v in tree_flatten(mod.parameters()) if k.split(".")[-2] in BRANCH_OUT]
            mod.update(tree_unflatten(small))
    lm = target.language_model if hasattr(target, "language_model") else target
    out = arch_mod.text_model(target).embed_tokens if tied else lm.lm_head
    out.weight = out.weight * LOGIT_SCALE
    if head == "agree":
        mtp.fc.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    elif head == "never":
        mtp.fc.weight = mx.zeros((hidden, 2 * hidden))
        out.weight[0] = 0.0          # token 0's logit is 0, below the maximum of the others


def write_checkpoint(dst, arch: str = "qwen3", vocab: int = QWEN3_VOCAB, *, dtype: str = "bfloat16",
                     tied: bool = False, quantized: bool = False, head: str = "agree", hidden: int = 64,
                     layers: int = 4, seed: int = 0) -> Path:
    """Write an mlx-layout checkpoint (config.json, model.safetensors, tokenizer) to `dst`."""
    if head not in HEADS:
        raise ValueError(f"head={head!r} is not one of {HEADS}")
    if quantized and hidden % 64:
        raise ValueError(f"hidden={hidden} must be a multiple of 64 to quantize with group size 64")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = config(arch, vocab, tied, hidden, layers)
    mx.random.seed(seed)
    target, mtp, arch_mod = _modules(cfg)
    _shape_weights(target, mtp, arch_mod, head, tied, hidden)
    dt = getattr(mx, dtype)
    for mod in (target, mtp):
        mod.update(tree_unflatten([(k, v.astype(dt)) for k, v in tree_flatten(mod.parameters())]))
    if quantized:
        wide = _quantize(target, 64)
        _quantize(mtp, 32)
        cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine", **wide}
        cfg["mtplx_mtp_quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    weights = dict(tree_flatten(target.parameters()))
    if head != "none":
        weights.update({f"mtp.{k}": v for k, v in tree_flatten(mtp.parameters())})
    mx.eval(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(dst, vocab)
    return dst


def write_suite(root, names=None) -> dict:
    """Write the standard set (or the named members) under `root`; returns name -> path."""
    root = Path(root)
    return {name: write_checkpoint(root / name, **SUITE[name]) for name in (names or SUITE)}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: python -m mtplx.synthetic DIR [NAME ...]   (names: {', '.join(SUITE)})")
    for name, path in write_suite(sys.argv[1], sys.argv[2:] or None).items():
        print(name, path)
