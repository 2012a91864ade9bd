"""The MTP draft head (DeepSeek-V3 / Qwen3-Next style), shared by every architecture.

Input at position t: the target's post-norm hidden state h_t and the embedding of token t+1.
Output: a post-norm hidden whose `lm_head` projection predicts token t+2. The head owns a small
stack of decoder blocks (usually one) built from the target architecture's own block class, and
its own KV cache ("MTP history"). Weight names follow the checkpoints: `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.layers.N.*`, `mtp.norm`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, make_block: Callable[[], nn.Module], num_layers: int = 1):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [make_block() for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, next_embeds: mx.array, cache: Optional[Sequence] = None) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)
