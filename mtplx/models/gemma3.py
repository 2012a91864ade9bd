"""Gemma 3 text (`gemma3_text`): mlx-lm's architecture plus our MTP head.

What the engine needs to know beyond `qwen3.py`'s protocol:
- Five of every six layers attend over a sliding window of `sliding_window` keys (a query at
  position p sees keys p - W + 1 .. p); every `sliding_window_pattern`-th layer is global.
  mlx-lm gives the sliding layers a `RotatingKVCache`. Here every layer gets a full per-row
  `KVCache` (`make_cache`), and the window is a mask: mlx-lm's own `Gemma3Model` asks the first
  layer's cache for `make_mask(N, window_size=W)`, which mlx-lm's `KVCache` and our ragged lane
  cache (`RaggedKVCache.make_mask`) both answer with exactly the keys a rotating cache would hold.
  So a verify of several speculative positions, a prefill chunk longer than the window, rows of
  different lengths in one lane and a rollback (an offset moved back) are all exact with no
  state beyond the offset, and every path the engine has (ragged commits on the host or the
  device, compiled graphs, prefill together, prefix snapshots, moving rows between lanes) works
  as it does for a global layer. The sliding layers read only each row's window band of the
  buffer (`Attention`), so attention costs what a rotating cache's would. What the full buffer
  costs is memory: a sliding layer keeps every position, not W + (verify positions - 1) (the
  least a per-row rotating buffer needs to roll back), so at long contexts about 5/6 of the KV
  could be saved by one; the KV budget counts what is held.
- Gemma's RMSNorm scales by `1 + w`, its embedding is multiplied by sqrt(hidden_size) (rounded
  to bfloat16, as mlx-lm does), its MLP is gelu (tanh approximation) gated, attention scales by
  `query_pre_attn_scalar ** -0.5`, and local and global layers have RoPE bases of their own: all
  inside mlx-lm's classes, which run unchanged apart from the attention kernel.
- The head is tied to the embedding when the checkpoint has no `lm_head.weight` (Gemma 3 270M
  is). Gemma 3 has no final logit soft-capping (Gemma 2 had; mlx-lm's `gemma3_text` has none).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import KVCache

from .cache import window_band
from .cpu_ops import attention

MODEL_TYPES = ("gemma3_text",)


def text_model(target: nn.Module) -> nn.Module:
    return target.model


def hidden_states(target: nn.Module, inputs: mx.array, cache=None) -> mx.array:
    """Post-norm hidden states [B, T, H] for token ids [B, T] (mlx-lm's model builds the global
    and the sliding-window masks from the caches)."""
    return target.model(inputs, cache)


def logits(target: nn.Module, hidden: mx.array) -> mx.array:
    if target.tie_word_embeddings:     # set by mlx-lm's sanitize when there is no lm_head.weight
        return target.model.embed_tokens.as_linear(hidden)
    return target.lm_head(hidden)


def embed(target: nn.Module, tokens: mx.array) -> mx.array:
    """The input the target's first layer sees for these tokens: the embedding scaled by
    sqrt(hidden_size) in mlx-lm's rounding (the MTP head takes the same)."""
    h = target.model.embed_tokens(tokens)
    return h * mx.array(target.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)


class Attention(gemma3_text.Attention):
    """mlx-lm's Gemma 3 attention (same weights, norms, RoPE), calling our `attention`: the CPU
    softmax paths for long or uneven spans (`cpu_ops`). The mask (causal, or the window) is
    mlx-lm's model's. A sliding layer over a cache longer than its window attends over each
    row's window band only (`window_band`): the same keys, without reading the whole context
    (at the 270M's shapes, B8: an attention layer 2.3x cheaper at 1k positions, 4-6x at 2k, 11x
    at 4k, in 15 of its 18 layers)."""

    window: int = 0                # the sliding window (0: a global layer); set by `_use_cpu_ops`

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3))
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
            band = window_band(cache, k, v, mask, offset, self.window) \
                if self.window and isinstance(mask, mx.array) else None
            if band is not None:      # a band, not the cache's span: no split by row span (cpu_ops)
                (k, v, mask), cache = band, None
        out = attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _use_cpu_ops(module: nn.Module, window: int = 0) -> None:
    for m in module.modules():
        if type(m) is gemma3_text.Attention:
            m.__class__ = Attention
            m.window = window if m.is_sliding else 0


def prepare_target(target: nn.Module) -> None:
    _use_cpu_ops(target, int(target.args.sliding_window))


def make_cache(target: nn.Module) -> list:
    """A full `KVCache` per layer, sliding-window layers included: the window is the mask's (see
    the module doc), so per-row rollback is an offset move and lane rows keep every key."""
    return [KVCache() for _ in target.model.layers]


def _global_layer(args) -> int:
    return args.sliding_window_pattern - 1


def make_mtp_block(args) -> nn.Module:
    """One Gemma 3 block for the head, of a global layer (full causal attention with the global
    RoPE base: the head's `create_attention_mask` is plain causal)."""
    block = gemma3_text.TransformerBlock(args, layer_idx=_global_layer(args))
    assert not block.self_attn.is_sliding
    _use_cpu_ops(block)
    return block


def hidden_size(args) -> int:
    return args.hidden_size


def rms_norm_eps(args) -> float:
    return args.rms_norm_eps
