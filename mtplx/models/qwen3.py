"""Qwen3 (dense, full attention): mlx-lm's architecture plus our MTP head.

An architecture module tells the engine three things about an mlx-lm model: how to get the
post-norm hidden states, how to project them to logits with the shared head, and how to build
one MTP decoder block. Everything else (caches, decoding) is architecture-neutral.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from .cpu_ops import attention

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


class Attention(qwen3.Attention):
    """mlx-lm's Qwen3 attention (same weights and projections), calling our `attention`."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _use_cpu_ops(module: nn.Module) -> None:
    """Our attention class for mlx-lm's (same weights, same projections)."""
    for m in module.modules():
        if type(m) is qwen3.Attention:
            m.__class__ = Attention


def prepare_target(target: nn.Module) -> None:
    _use_cpu_ops(target)


def make_mtp_block(args) -> nn.Module:
    block = qwen3.TransformerBlock(args)
    _use_cpu_ops(block)
    return block


def hidden_size(args) -> int:
    return args.hidden_size


def rms_norm_eps(args) -> float:
    return args.rms_norm_eps
