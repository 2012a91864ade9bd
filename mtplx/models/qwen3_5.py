"""Qwen3.5 / Qwen3.6 (`qwen3_5` dense, `qwen3_5_moe` = the "A3B"): mlx-lm's hybrid GDN +
full-attention architecture plus our MTP head.

mlx-lm's `Model` wraps a `TextModel` (`language_model`) built from `text_config`. The MTP block is
mlx-lm's own `DecoderLayer` with the full-attention layer type, and its MLP as the target's (MoE
when the config has experts). GDN layers get a per-position capturing forward at load time
(`prepare_target`) and `RecurrentCache`s (`make_cache`), so verify positions roll back by
capture-commit.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5

from . import hybrid

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
MTP_PREFIXES = ("mtp.", "language_model.mtp.", "model.mtp.")


def _text_args(args):
    if isinstance(args, qwen3_5.TextModelArgs):
        return args
    return qwen3_5.TextModelArgs.from_dict(args.text_config)


def text_model(target: nn.Module) -> nn.Module:
    return target.language_model.model


def hidden_states(target: nn.Module, inputs: mx.array, cache=None) -> mx.array:
    """Post-norm hidden states [B, T, H] for token ids [B, T]."""
    return target.language_model.model(inputs, cache)


def logits(target: nn.Module, hidden: mx.array) -> mx.array:
    lm = target.language_model
    if lm.args.tie_word_embeddings:
        return lm.model.embed_tokens.as_linear(hidden)
    return lm.lm_head(hidden)


def embed(target: nn.Module, tokens: mx.array) -> mx.array:
    return target.language_model.model.embed_tokens(tokens)


def make_mtp_block(args) -> nn.Module:
    targs = _text_args(args)
    block = qwen3_5.DecoderLayer(targs, layer_idx=targs.full_attention_interval - 1)
    assert not block.is_linear
    return block


def hidden_size(args) -> int:
    return _text_args(args).hidden_size


def rms_norm_eps(args) -> float:
    return _text_args(args).rms_norm_eps


def make_cache(target: nn.Module) -> list:
    return hybrid.make_cache(text_model(target).layers)


def prepare_target(target: nn.Module) -> None:
    hybrid.prepare_layers(text_model(target).layers)


def sanitize_mtp(weights: dict, path: Path, args) -> dict:
    """mlx-lm's own rule for the target: an HF (unconverted) checkpoint has conv1d weights
    [C, 1, K]; then norms are zero-centred."""
    shapes = hybrid.checkpoint_shapes(path)
    raw = any("conv1d.weight" in k and len(s) == 3 and s[-1] != 1 for k, s in shapes.items())
    return hybrid.sanitize_mtp(weights, raw=raw, num_experts=_text_args(args).num_experts)
