"""Qwen3-Next (`qwen3_next`): mlx-lm's hybrid GDN + full-attention MoE architecture plus our MTP
head. The MTP block is mlx-lm's `Qwen3NextDecoderLayer` with the full-attention layer type; its
MLP follows the rule the checkpoint's MTP layer 0 has (sparse MoE when the config has experts and
layer 0 is sparse, else the dense MLP). GDN rollback is capture-commit (see `qwen3_5`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx_lm.models import qwen3_next

from . import hybrid, qwen3

# Same text-model layout as qwen3 (post-norm hidden from `target.model`, tied or separate head): the
# architecture interface the loader calls (`embed`, `hidden_states`, ...) is qwen3's.
embed, hidden_size, hidden_states, logits = qwen3.embed, qwen3.hidden_size, qwen3.hidden_states, qwen3.logits
rms_norm_eps, text_model = qwen3.rms_norm_eps, qwen3.text_model

MODEL_TYPES = ("qwen3_next",)
MTP_PREFIXES = ("mtp.", "model.mtp.")


def make_mtp_block(args) -> nn.Module:
    block = qwen3_next.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    assert not block.is_linear
    sparse = args.num_experts > 0 and 0 not in args.mlp_only_layers and 1 % args.decoder_sparse_step == 0
    if sparse and not isinstance(block.mlp, qwen3_next.Qwen3NextSparseMoeBlock):
        block.mlp = qwen3_next.Qwen3NextSparseMoeBlock(args)
    elif not sparse and not isinstance(block.mlp, qwen3_next.Qwen3NextMLP):
        block.mlp = qwen3_next.Qwen3NextMLP(args.hidden_size, args.intermediate_size)
    return block


def make_cache(target: nn.Module) -> list:
    return hybrid.make_cache(text_model(target).layers)


def prepare_target(target: nn.Module) -> None:
    hybrid.prepare_layers(text_model(target).layers)


def sanitize_mtp(weights: dict, path: Path, args) -> dict:
    """mlx-lm's own rule for the target: an HF checkpoint stores one tensor per expert; then
    norms are zero-centred."""
    shapes = hybrid.checkpoint_shapes(path)
    raw = any(k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight") for k in shapes)
    return hybrid.sanitize_mtp(weights, raw=raw, num_experts=args.num_experts)
