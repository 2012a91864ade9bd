"""Qwen3 (dense, full attention): mlx-lm's architecture plus our MTP head.

An architecture module tells the engine three things about an mlx-lm model: how to get the
post-norm hidden states, how to project them to logits with the shared head, and how to build
one MTP decoder block. Everything else (caches, decoding) is architecture-neutral.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from .cpu_ops import apply_rope, attention, rope_tables, shares_rope_tables, swiglu

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


class MLP(qwen3.MLP):
    """mlx-lm's Qwen3 MLP with our `swiglu` (its sigmoid's exponential is the CPU kernel's)."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


DECODE_POSITIONS = 4      # a lane's widest verify (primary and three drafts): the widest input the fused decode path takes


class TransformerBlock(qwen3.TransformerBlock):
    """mlx-lm's Qwen3 block. In decode steps over a lane's per-row cache (at most DECODE_POSITIONS
    positions), the work before the cache write (norm, projections, q/k norms, RoPE) and after
    the attention (output projection, residuals, norm, MLP) runs as two compiled graphs, one per
    input shape: at these sizes a forward is bound by per-operation dispatch, not arithmetic.
    Measured on the shipped model (2-core CPU, cycles alternating in one lane): 5-8% off a B8
    cycle. The cache write and the attention stay eager: they read each row's live span."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        offset = getattr(cache, "offset", None)
        if x.shape[1] > DECODE_POSITIONS or not isinstance(offset, mx.array):
            return super().__call__(x, mask, cache)
        rotation, pre, post = self._fused()
        q, k, v = pre(x, *rotation(offset, x.shape[1], x.dtype))
        k, v = cache.update_and_fetch(k, v)
        return post(x, attention(q, k, v, cache=cache, scale=self.self_attn.scale, mask=mask))

    def _fused(self):
        fused = self.__dict__.get("_fused_parts")
        if fused is None:
            a = self.self_attn
            shared = shares_rope_tables(a.rope)

            def rotation(offset, T, dtype):      # pre's RoPE inputs: (cos, sin) shared by the layers, or (offset,)
                return rope_tables(a.rope, offset, T, dtype) if shared else (offset,)

            def pre(x, *rot):
                B, L, _ = x.shape
                y = self.input_layernorm(x)
                q = a.q_norm(a.q_proj(y).reshape(B, L, a.n_heads, -1)).transpose(0, 2, 1, 3)
                k = a.k_norm(a.k_proj(y).reshape(B, L, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
                v = a.v_proj(y).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
                if shared:
                    return apply_rope(q, *rot), apply_rope(k, *rot), v
                return a.rope(q, offset=rot[0]), a.rope(k, offset=rot[0]), v

            def post(x, out):
                B, L, _ = x.shape
                h = x + a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
                return h + self.mlp(self.post_attention_layernorm(h))

            fused = self.__dict__["_fused_parts"] = (rotation, mx.compile(pre), mx.compile(post))
        return fused


def _use_cpu_ops(module: nn.Module) -> None:
    """Our attention, block and MLP classes for mlx-lm's (same weights, same projections)."""
    for m in module.modules():
        if type(m) is qwen3.Attention:
            m.__class__ = Attention
        elif type(m) is qwen3.TransformerBlock:
            m.__class__ = TransformerBlock
        elif type(m) is qwen3.MLP:
            m.__class__ = MLP


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
