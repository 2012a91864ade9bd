"""What training an MTP head by self-distillation needs, shared by `mtplx train-head` and the
shipped model's training script (`scripts/train_shipped_model.py`): the target's own text, the
soft cross-entropy against its distribution, the training loop (AdamW, warm-up then cosine,
gradients clipped; resumable from a checkpoint) and the chain arithmetic.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


def mlx_lm_classes(module: nn.Module) -> None:
    """mlx-lm's own classes for the engine's subclasses of them (same weights): training
    differentiates through the head, and the engine's CPU exponential has no gradient."""
    for m in module.modules():
        base = type(m).__mro__[1]
        if type(m).__module__.startswith("mtplx.") and base.__module__.startswith("mlx_lm."):
            m.__class__ = base


def continue_text(model, prompts: mx.array, new_tokens: int, temperature: float) -> np.ndarray:
    """Prompts [B, P] continued by the target (`model.target`) for `new_tokens`, through its KV
    cache: greedy at temperature 0, else sampled. Returns [B, P + new_tokens]."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.target)
    seq = [prompts]
    for _ in range(new_tokens):
        logits = model.target(seq[-1], cache=cache)[:, -1]
        seq.append((mx.argmax(logits, -1) if temperature == 0 else mx.random.categorical(logits / temperature))[:, None])
    return np.array(mx.concatenate(seq, axis=1))


def soft_cross_entropy(teacher: mx.array, logits: mx.array, mask: Optional[mx.array] = None) -> mx.array:
    """-sum teacher * log softmax(logits) over the last axis, averaged over the positions `mask`
    keeps (all when None). The teacher may carry less than all its mass (a distribution restricted
    to a draft vocabulary): the minimiser is still the teacher renormalised there."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    per_position = -(teacher * logp).sum(-1)
    if mask is None:
        return per_position.mean()
    return (per_position * mask).sum() / mx.maximum(mask.sum(), 1)


def tokens_per_chain(acceptance) -> float:
    """Tokens a row keeps per cycle at a depth of len(acceptance): the target's own plus each kept draft."""
    return float(1 + np.cumprod(acceptance).sum())


def lr_schedule(lr: float, steps: int):
    """Linear warm-up over min(50, steps / 5) steps (at least one) from lr / 20, then cosine decay
    to lr / 20."""
    warm = max(1, min(50, steps // 5))
    return optim.join_schedules(
        [optim.linear_schedule(lr / 20, lr, warm), optim.cosine_decay(lr, steps - warm, lr / 20)], [warm])


class Checkpoint:
    """A training run's state on disk: the trainable parameters, the optimizer's state and the
    step, written every `every_s` seconds and at the end (each file whole, then renamed), so that
    a killed run started again continues where it was."""

    def __init__(self, path: Path, every_s: float = 120.0):
        self.path, self.every_s = Path(path), every_s
        self.last = time.perf_counter()

    def load(self, model: nn.Module, opt) -> int:
        meta = self.path.with_suffix(".json")
        if not meta.is_file():
            return 0
        weights = mx.load(str(self.path.with_suffix(".params.safetensors")))
        model.load_weights(list(weights.items()), strict=False)
        opt.state = tree_unflatten(list(mx.load(str(self.path.with_suffix(".opt.safetensors"))).items()))
        return int(json.loads(meta.read_text())["step"])

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.every_s

    def save(self, model: nn.Module, opt, step: int, extra: Optional[dict] = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for suffix, tree in ((".params.safetensors", model.trainable_parameters()), (".opt.safetensors", opt.state)):
            tmp = self.path.with_suffix(".tmp" + suffix)
            mx.save_safetensors(str(tmp), dict(tree_flatten(tree)))
            os.replace(tmp, self.path.with_suffix(suffix))
        tmp = self.path.with_suffix(".tmp.json")
        tmp.write_text(json.dumps({"step": step, **(extra or {})}))
        os.replace(tmp, self.path.with_suffix(".json"))
        self.last = time.perf_counter()


def fit(model: nn.Module, loss_fn: Callable, trainable: Callable, steps: int, lr: float, batch: Callable,
        label: str, checkpoint: Optional[Checkpoint] = None, progress: bool = True, log_every: int = 50) -> dict:
    """Train the parameters `trainable(model)` unfreezes for `steps` steps of AdamW (weight decay
    0.01, `lr_schedule`, gradients clipped to norm 1) on `loss_fn(model, batch(i))` -> (loss, (a, b)),
    `batch(i)` being step i's batch (a function of i, so that a resumed run sees the batches it
    would have). Returns the last losses and the throughput."""
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps), weight_decay=0.01)
    model.freeze()
    trainable(model)
    opt.init(model.trainable_parameters())
    start = checkpoint.load(model, opt) if checkpoint is not None else 0
    state = [model.state, opt.state]
    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step(x):
        (loss, parts), grads = value_and_grad(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, parts

    step = mx.compile(step, inputs=state, outputs=state)
    bar = _progress(steps, start, label) if progress else None
    t0, seen, out = time.perf_counter(), 0, {}
    for i in range(start, steps):
        x = batch(i)
        loss, (a, b) = step(x)
        mx.eval(state, loss)
        seen += x[0].shape[0] * x[0].shape[1] if isinstance(x, tuple) else x.size
        dt = time.perf_counter() - t0
        out = {"loss": loss.item(), "a": a.item(), "b": b.item(), "tok_s": seen / dt, "minutes": dt / 60}
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", first=f"{out['a']:.3f}", last=f"{out['b']:.3f}",
                            tok_s=f"{out['tok_s']:,.0f}", refresh=False)
        elif i % log_every == 0 or i == steps - 1:
            print(f"[{label}] step {i:5d}/{steps} loss {out['loss']:.3f} ce {out['a']:.3f} "
                  f"mtp {out['b']:.3f}  {out['tok_s']:,.0f} tok/s  {out['minutes']:.1f} min", flush=True)
        if checkpoint is not None and (checkpoint.due() or i == steps - 1):
            checkpoint.save(model, opt, i + 1)
    if bar is not None:
        bar.close()
    model.unfreeze()
    return out


def _progress(total: int, initial: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit="step", file=sys.stderr, mininterval=5.0,
                dynamic_ncols=True)
