"""The target's own text, with what distilling a head on it needs: batched continuations of prompts
that keep, at every position, the target's post-norm hidden state (the head's input, and through
the output layer the teacher's logits) and the logsumexp of its logits over the whole vocabulary
(so that the teacher's probabilities on any subset of tokens are exact without keeping the
logits). A second forward over the text would cost as much as writing it.

A batch of prompts of different lengths is left-padded (mlx-lm's `BatchKVCache`: each row's
positions and masks start at its first real token), so every row's continuation starts at the
same index, `prompt_end`. Shards of one batch each are written whole, then renamed: generation
started again skips the shards it has (each shard's prompts and random draws are fixed by its
index), so a killed run continues.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from mtplx.sampling import inverse_cdf, to_host

PAD = 0


@dataclass
class Shard:
    tokens: np.ndarray        # [B, L] int32, left-padded with PAD
    start: np.ndarray         # [B] each row's first real position
    prompt_end: int           # the index of every row's first generated token
    end: np.ndarray           # [B] each row's text ends before this (after its first stop token: not served)
    hidden: np.ndarray        # [B, L, H] float16: the target's post-norm hidden state at each position
    lse: np.ndarray           # [B, L] float32: logsumexp of the target's logits there (from prompt_end - 1)
    temperature: np.ndarray   # [B] the temperature each row was written at (0: greedy)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, start=self.start, prompt_end=self.prompt_end, end=self.end,
                 hidden=self.hidden, lse=self.lse, temperature=self.temperature)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Shard":
        z = np.load(path)
        return cls(tokens=z["tokens"], start=z["start"], prompt_end=int(z["prompt_end"]), end=z["end"],
                   hidden=z["hidden"], lse=z["lse"], temperature=z["temperature"])


def write_batch(model, prompts: Sequence[Sequence[int]], new_tokens: int, temperatures: np.ndarray,
                seed: int, stop_ids: frozenset = frozenset()) -> Shard:
    """The target's continuations of `prompts` (one batch): `new_tokens` each, row b greedy where
    temperatures[b] is 0, else sampled at that temperature (from `seed`)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    pad = [P - len(p) for p in prompts]
    tokens = np.full((B, P + new_tokens), PAD, dtype=np.int32)
    for b, p in enumerate(prompts):
        tokens[b, pad[b]:P] = p
    caches = [BatchKVCache(pad) for _ in model.target.layers]
    rng = np.random.default_rng(seed)
    sampled = np.flatnonzero(temperatures > 0)
    hidden, lses, drawn = [], [], []
    x = mx.array(tokens[:, :P])
    for _ in range(new_tokens):
        h = model.hidden(x, caches)
        hidden.append(h.astype(mx.float16))
        lse, nxt = _lse_and_draw(to_host(model.logits(h[:, -1])), temperatures, sampled, rng)
        lses.append(lse)
        drawn.append(nxt)
        x = mx.array(nxt[:, None].astype(np.int32))
    # the last position's hidden (its logits predict past the text: not needed as a teacher,
    # but it is the head's input at the last start)
    h_last = model.hidden(x, caches).astype(mx.float16)
    hidden = np.array(mx.concatenate(hidden + [h_last], axis=1))
    tokens[:, P:] = np.stack(drawn, axis=1)
    lse = np.full((B, P + new_tokens), np.nan, dtype=np.float32)
    lse[:, P - 1:P - 1 + new_tokens] = np.stack(lses, axis=1)
    end = np.full(B, P + new_tokens, dtype=np.int64)
    for b in range(B):
        stops = [i for i in range(P, P + new_tokens) if int(tokens[b, i]) in stop_ids]
        if stops:
            end[b] = stops[0] + 1          # the stop token is the last token served
    return Shard(tokens=tokens, start=np.array(pad, dtype=np.int64), prompt_end=P, end=end, hidden=hidden,
                 lse=lse, temperature=np.asarray(temperatures, dtype=np.float32))


def _lse_and_draw(logits: np.ndarray, temperatures: np.ndarray, sampled: np.ndarray,
                  rng: np.random.Generator) -> tuple:
    """Each row's logsumexp and next token: the argmax, or for the rows `sampled` a draw at their
    temperature. On the host: MLX's CPU exponential costs ~12 ns an element, numpy's well under
    one: on Gemma 3 270M at B32 MLX's logsumexp and draw took 294 ms after a 265 ms forward, the
    host's 37 ms."""
    top = logits.max(axis=-1, keepdims=True)
    shifted = logits - top
    lse = top[:, 0] + np.log(np.exp(shifted).sum(axis=-1))
    nxt = logits.argmax(axis=-1)
    for b in sampled:
        nxt[b] = inverse_cdf(np.exp(shifted[b] / temperatures[b]), rng.random())
    return lse.astype(np.float32), nxt


def write_shards(model, prompts: list, out_dir: Path, name: str, batch: int, new_tokens: int,
                 temperatures: Sequence[float], seed: int, stop_ids: frozenset = frozenset(),
                 progress: Optional[object] = None) -> list:
    """All shards of a prompt list (`name`_NNNN.npz under out_dir; those already there are kept).
    Row r of the list is written at temperatures[r % len(temperatures)]. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(out_dir / f"{name}.json", {
        "prompts": len(prompts), "batch": batch, "new_tokens": new_tokens, "temperatures": list(temperatures),
        "seed": seed, "prompt_ids": hashlib.sha256(repr([p.ids for p in prompts]).encode()).hexdigest()})
    paths = []
    for s, lo in enumerate(range(0, len(prompts), batch)):
        path = out_dir / f"{name}_{s:04d}.npz"
        paths.append(path)
        if not path.exists():
            rows = prompts[lo:lo + batch]
            temps = np.array([temperatures[(lo + r) % len(temperatures)] for r in range(len(rows))])
            write_batch(model, [p.ids for p in rows], new_tokens, temps, seed * 100_003 + s, stop_ids).save(path)
        if progress is not None:
            progress(len(prompts[lo:lo + batch]))
    return paths


def _check_manifest(path: Path, settings: dict) -> None:
    """Shards already written are kept only for the settings they were written with."""
    if path.exists():
        was = json.loads(path.read_text())
        if was != settings:
            changed = sorted(k for k in settings if was.get(k) != settings[k])
            raise ValueError(f"{path.parent} holds the target's text written with other settings ({', '.join(changed)}): "
                             "remove it, or give another work directory")
        return
    path.write_text(json.dumps(settings))
