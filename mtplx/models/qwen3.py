"""Qwen3 (dense, full attention): mlx-lm's architecture plus our MTP head.

An architecture module tells the engine three things about an mlx-lm model: how to get the
post-norm hidden states, how to project them to logits with the shared head, and how to build
one MTP decoder block. Everything else (caches, decoding) is architecture-neutral.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

MODEL_TYPES = ("qwen3",)


def text_model(target: nn.Module) -> nn.Module:
    return target.model


def hidden_states(target: nn.Module, inputs: mx.array, cache=None) -> mx.array:
    """Post-norm hidden states [B, T, H] for token ids [B, T]."""
    return target.model(inputs, cache)


def logits(target: nn.Module, hidden: mx.array) -> mx.array:
    if target.args.tie_word_embeddings:
        return target.model.embed_tokens.as_linear(hidden)
    return target.lm_head(hidden)


def embed(target: nn.Module, tokens: mx.array) -> mx.array:
    return target.model.embed_tokens(tokens)


def make_mtp_block(args) -> nn.Module:
    return qwen3.TransformerBlock(args)


def hidden_size(args) -> int:
    return args.hidden_size


def rms_norm_eps(args) -> float:
    return args.rms_norm_eps
