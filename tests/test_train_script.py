"""The shipped model's training script: its chained drafts are the engine's, and its phase-3 loss
trains the head alone."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_shipped_model", ROOT / "scripts" / "train_shipped_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(script):
    model, tok, card = script.load_checkpoint(ROOT / "mtplx" / "assets" / "mtplx-tiny-py")
    return model


def _tokens(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(3, 4096, size=(2, n)).astype(np.int32))


def test_chained_drafts_are_the_heads_chain_through_its_cache(script, trained):
    """What phase 3 trains and the eval measures: draft k from start p, computed for every p at
    once, equals the head run as drafting runs it (its history through p in its KV cache, then
    each chained draft from its own last output)."""
    arch, x = trained._arch, _tokens(40)
    h = arch.hidden_states(trained.target, x)
    emb = arch.embed(trained.target, x[:, 1:])
    outs = script.chained_drafts(trained.mtp, h[:, :36], emb, 3)
    assert mx.abs(outs[0] - trained.mtp(h[:, :36], emb[:, :36])).max().item() == 0.0
    assert mx.abs(script.chained_drafts(trained.mtp, h[:, :36], emb, 1)[0] - outs[0]).max().item() == 0.0
    for p in (0, 17, 35):
        cache = [KVCache() for _ in trained.mtp.layers]
        g = trained.mtp(h[:, :p + 1], emb[:, :p + 1], cache)[:, -1:]
        assert mx.abs(g[:, 0] - outs[0][:, p]).max().item() < 1e-5
        for k in (1, 2):
            g = trained.mtp(g, emb[:, p + k:p + k + 1], cache)
            assert mx.abs(g[:, 0] - outs[k][:, p]).max().item() < 1e-5, (p, k)


def test_phase3_loss_trains_the_head_alone(script, trained):
    """One phase-3 gradient: finite, on every head parameter, none on the target's."""
    x = _tokens(script.GEN_PROMPT + 2 * script.CHAIN, seed=1)
    trained.freeze()
    trained.mtp.unfreeze()
    try:
        (loss, _), grads = nn.value_and_grad(trained, script.phase3_loss)(trained, x)
    finally:
        trained.unfreeze()
    assert np.isfinite(loss.item())
    flat = tree_flatten(grads)
    assert flat and all(name.startswith("mtp.") for name, _ in flat)
    flat = [g for _, g in flat]
    assert flat and all(bool(mx.all(mx.isfinite(g)).item()) for g in flat)
    assert any(mx.abs(g).max().item() > 0 for g in flat)
