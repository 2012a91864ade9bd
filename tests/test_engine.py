"""Engine foundation: runtime, loading, and exact solo decoding on the shipped model."""

import json
import shutil
import sys

import mlx.core as mx
import numpy as np
import pytest

import mtplx
from mtplx.engine.decode import generate_ar, generate_mtpk
from mtplx.engine.prefill import CapacityError
from mtplx.models.errors import CheckpointShapeError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from mtplx.models.loader import SHIPPED_MODEL
from mtplx.sampling import SamplerConfig

from references import greedy_ar

GREEDY = SamplerConfig(temperature=0.0)

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
    "# Parse the command line\nimport argparse\n", "for i in range(10):\n", "try:\n    import json",
    "    def __repr__(self):\n        return", "'''Utilities for working with files.'''\n",
    "if __name__ == '__main__':\n", "def read_lines(path):\n    with open(path) as f:",
    "x", "@property\ndef name(self):", "raise ValueError(", "return self._data[",
    "while True:\n    line = input()", "lambda x:", "from collections import",
    "def __eq__(self, other):\n    if not isinstance(other,", "assert ", "with self._lock:\n",
]


def test_runtime_reports_live_blas():
    from mtplx.runtime import set_blas_threads

    info = mtplx.runtime_info()
    assert info["mlx_version"] and info["mlx_device"]
    if sys.platform == "darwin":
        assert info["blas"] == "accelerate" and set_blas_threads(1) is None
        return
    # Linux: scripts/setup.sh installs Debian's OpenBLAS, and the engine must load it itself
    # (DESIGN.md); its thread count can be set after it is loaded
    assert info["blas"] == "openblas", info["blas_note"]
    before = set_blas_threads()
    try:
        assert set_blas_threads(1) == 1 and mtplx.runtime_info()["blas_threads"] == 1
        assert set_blas_threads(2) == 2
    finally:
        set_blas_threads(before)


def test_shipped_model_loads_with_mtp_and_chat_template(model):
    assert model.mtp is not None and model.mtp_disabled_reason is None
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert model.eos_token_ids


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_mtp_equals_ar(model, depth):
    tok = model.tokenizer
    mismatches, accepted = [], 0
    for text in PROMPTS:
        ids = tok.encode(text)
        mtp = generate_mtpk(model, ids, 128, GREEDY, depth=depth)
        accepted += mtp.stats["accepted_drafts"]
        if mtp.tokens != greedy_ar(model, ids, 128):
            mismatches.append(text)
        assert mtp.stats["verify_calls"] < len(mtp.tokens)  # speculation did something
    assert not mismatches
    assert accepted > 0


def test_depth3_and_omit_bonus_stay_exact(model):
    ids = model.tokenizer.encode("def parse(value):\n")
    ar = generate_ar(model, ids, 64, GREEDY)
    assert generate_mtpk(model, ids, 64, GREEDY, depth=3).tokens == ar.tokens
    no_bonus = generate_mtpk(model, ids, 64, GREEDY, omit_speculative_bonus=True)
    assert no_bonus.tokens == ar.tokens


def test_sampled_runs_reproducible_per_seed(model):
    ids = model.tokenizer.encode("import ")
    cfg = SamplerConfig(temperature=0.8)
    a = generate_mtpk(model, ids, 48, cfg, seed=7)
    b = generate_mtpk(model, ids, 48, cfg, seed=7)
    c = generate_mtpk(model, ids, 48, cfg, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert generate_ar(model, ids, 48, cfg, seed=7).tokens == generate_ar(model, ids, 48, cfg, seed=7).tokens


def test_sampled_mtp_keeps_target_joint_distribution(model):
    """End to end through the real model: the (t1, t2) pair from MTP (t2 goes through draft,
    verify and residual) follows the target's exact joint p(t1) p(t2 | t1). Chi-square, df 8,
    false-alarm rate 1e-4, fixed seeds. `generate_mtpk` is a one-row lane and a sampled row's
    draws depend only on its seed, so the 1500 seeds' rows run eight at a time in a running lane;
    the first 24 seeds also run through `generate_mtpk` and must give the same tokens."""
    from test_lane import seeded_outcomes
    from test_sampling import ALPHA, chi2_sf_even, chi2_stat

    from mtplx.engine.install import install_a3b_mtp_batch_lane
    from mtplx.engine.lane import RunningLane
    from mtplx.sampling import distribution

    ids = model.tokenizer.encode("def ")
    cfg = SamplerConfig(temperature=1.0, top_k=3, top_p=1.0)
    p1 = distribution(np.array(model.logits(model.hidden(mx.array([ids])))[0, -1]), cfg)
    firsts = np.flatnonzero(p1)
    joint = {}
    for t1 in firsts:
        p2 = distribution(np.array(model.logits(model.hidden(mx.array([ids + [int(t1)]])))[0, -1]), cfg)
        for t2 in np.flatnonzero(p2):
            joint[(int(t1), int(t2))] = p1[t1] * p2[t2]
    cells = sorted(joint)
    running = RunningLane(install_a3b_mtp_batch_lane(model, 8, selfcheck=False))
    streams, _ = seeded_outcomes(running, ids, 1500, 2, cfg, cfg)
    for s in range(24):
        assert generate_mtpk(model, ids, 2, cfg, seed=s).tokens == streams[s].tokens, s
    counts = np.zeros(len(cells), dtype=np.int64)
    for stream in streams:
        counts[cells.index(tuple(stream.tokens))] += 1
    probs = np.array([joint[c] for c in cells])
    assert len(cells) == 9 and sum(s.accepted_drafts for s in streams) > 300
    assert chi2_sf_even(chi2_stat(counts, probs), len(cells) - 1) > ALPHA


def test_stop_tokens_and_limits(model):
    ids = model.tokenizer.encode("import os\n")
    ar = generate_ar(model, ids, 40, GREEDY)
    stop = ar.tokens[5]
    first = ar.tokens.index(stop)
    for gen in (generate_ar, generate_mtpk):
        r = gen(model, ids, 40, GREEDY, stop_token_ids={stop})
        assert r.finish_reason == "stop" and r.tokens == ar.tokens[:first + 1]
        one = gen(model, ids, 1, GREEDY)
        assert one.tokens == ar.tokens[:1] and one.finish_reason == "length"
        single = gen(model, [ids[0]], 8, GREEDY)
        assert len(single.tokens) == 8


def test_context_limit(model):
    limit = model.max_context
    ids = [5] * (limit - 4)
    r = generate_mtpk(model, ids, 4, GREEDY)
    assert len(r.tokens) == 4
    with pytest.raises(CapacityError, match="context window"):
        generate_ar(model, ids, 5, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        generate_ar(model, [], 5, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        generate_mtpk(model, [1], 0, GREEDY)


def _copy_model(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(SHIPPED_MODEL, dst)
    return dst


def test_loader_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        mtplx.load_model(tmp_path / "nope")
    bad = _copy_model(tmp_path)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        mtplx.load_model(bad)
    cfg = json.loads((SHIPPED_MODEL / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt9")))
    with pytest.raises(UnsupportedModelError, match="gpt9"):
        mtplx.load_model(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=cfg["hidden_size"] * 2)))
    with pytest.raises(CheckpointShapeError):
        mtplx.load_model(bad)


def test_checkpoint_without_mtp_loads_ar_only(tmp_path):
    dst = _copy_model(tmp_path)
    weights = mx.load(str(dst / "model.safetensors"))
    mx.save_safetensors(str(dst / "model.safetensors"),
                        {k: v for k, v in weights.items() if not k.startswith("mtp.")})
    m = mtplx.load_model(dst)
    assert m.mtp is None and "no mtp" in m.mtp_disabled_reason
    assert len(generate_ar(m, [1, 2, 3], 4, GREEDY).tokens) == 4
    with pytest.raises(ValueError, match="no MTP head"):
        generate_mtpk(m, [1, 2, 3], 4, GREEDY)


def test_quantized_checkpoint_loads(tmp_path):
    """mlx-lm-quantized target and MTP head (4-bit) load and decode exactly (MTP == AR)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    m = mtplx.load_model()
    nn.quantize(m.target, group_size=32, bits=4, class_predicate=lambda p, mod: isinstance(mod, nn.Linear))
    nn.quantize(m.mtp, group_size=32, bits=4, class_predicate=lambda p, mod: isinstance(mod, nn.Linear))
    dst = tmp_path / "q"
    shutil.copytree(SHIPPED_MODEL, dst)
    weights = dict(tree_flatten(m.target.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(m.mtp.parameters())})
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (dst / "config.json").write_text(json.dumps(cfg))
    q = mtplx.load_model(dst)
    assert q.mtp is not None
    ids = q.tokenizer.encode("def main():")
    assert generate_mtpk(q, ids, 32, GREEDY).tokens == greedy_ar(q, ids, 32)
