"""An oracle that shares no code with ours (DESIGN.md, exactness contract 6): mlx-lm loads the
shipped checkpoint's target weights by itself and decodes greedily with its own `generate_step`;
our AR decoder, our MTP decoder at depths 1-3 and a width-3 lane must emit the same tokens, token
for token, or part from them only at a proven float32 tie (`references.assert_greedy_matches`).
mlx-lm's qwen3 class refuses the `mtp.*` tensors, so it reads a copy of the checkpoint without
them, written here with MLX's own safetensors functions. Everything here runs in the served
configuration: OpenBLAS on one thread, as a model replica runs it (restored afterwards)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from mlx_lm.utils import load as mlx_lm_load

from mtplx.a3b_mtp_batch import A3BMTPBatchRequest, generate_a3b_mtp_batch, install_a3b_mtp_batch_lane
from mtplx.generation import generate_ar, generate_mtpk
from mtplx.runtime import set_blas_threads
from mtplx.sampling import SamplerConfig

from references import assert_greedy_matches

SHIPPED = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "mtplx-tiny-py"   # what load_model() loads
TOKENS = 32
PROMPTS = (
    "def read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n    with open(path) as f:",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\n\nfor name in os.listdir('.'):\n    if name.endswith('.py'):",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for",
)
GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def served_blas():
    """One BLAS thread, as the replica serves (`set_blas_threads(... or 1)`), restored after."""
    before = set_blas_threads()
    set_blas_threads(1)
    yield
    if before:
        set_blas_threads(before)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """mlx-lm's model, and per prompt (prompt ids, its first TOKENS greedy tokens), the prompts
    encoded by mlx-lm's own tokenizer of the checkpoint."""
    target_only = tmp_path_factory.mktemp("target-only")
    weights = mx.load(str(SHIPPED / "model.safetensors"))
    mx.save_safetensors(str(target_only / "model.safetensors"),
                        {k: v for k, v in weights.items() if not k.startswith("mtp.")}, metadata={"format": "mlx"})
    config = json.loads((SHIPPED / "config.json").read_text())
    del config["mtp_num_hidden_layers"]
    (target_only / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, target_only / name)
    lm, tokenizer = mlx_lm_load(str(target_only))
    runs = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        runs.append((ids, [token for token, _ in generate_step(mx.array(ids), lm, max_tokens=TOKENS)]))
    return SimpleNamespace(lm=lm, runs=runs)


def test_the_oracle_is_mlx_lm_alone(oracle, model):
    """The oracle's layers are mlx-lm's own classes (ours swaps its attention, block and MLP
    classes on its own instance only), and it says something: its continuations differ from
    prompt to prompt."""
    layer = oracle.lm.model.layers[0]
    assert (type(layer), type(layer.self_attn), type(layer.mlp)) == \
        (qwen3.TransformerBlock, qwen3.Attention, qwen3.MLP)
    assert type(model.target.model.layers[0].self_attn) is not qwen3.Attention
    assert all(len(tokens) == TOKENS for _, tokens in oracle.runs)
    assert len({tuple(tokens) for _, tokens in oracle.runs}) == len(PROMPTS)


def test_greedy_ar_matches_mlx_lm(oracle, model):
    for ids, expected in oracle.runs:
        assert generate_ar(model, ids, max_tokens=TOKENS, sampler=GREEDY).tokens == expected


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_mtp_matches_mlx_lm(oracle, model, depth):
    for ids, expected in oracle.runs:
        result = generate_mtpk(model, ids, max_tokens=TOKENS, sampler=GREEDY, depth=depth)
        assert_greedy_matches(model, oracle.lm, ids, expected, result.tokens, depth)
        assert result.stats["accepted_drafts"] > 0      # the head drafted, and the drafts were verified


def test_a_divergence_that_is_no_tie_fails(oracle, model):
    """The tie check is no blanket: a token the oracle does not rank a near-second fails it."""
    ids, expected = oracle.runs[0]
    wrong = list(expected)
    wrong[5] = (expected[5] + 1) % model.vocab_size
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_matches(model, oracle.lm, ids, expected, wrong)


def test_greedy_lane_matches_mlx_lm(oracle, model):
    """A width-3 lane, full (three rows whose budgets end at different cycles) and then part full
    (two rows): each row is mlx-lm's text, cut at its budget."""
    lane = install_a3b_mtp_batch_lane(model, width=3)
    for cohort in (((0, TOKENS), (1, 12), (2, 20)), ((3, TOKENS), (0, 7))):
        requests = [A3BMTPBatchRequest(request_id=str(k), prompt_ids=tuple(oracle.runs[i][0]), sampler=GREEDY,
                                       max_tokens=budget) for k, (i, budget) in enumerate(cohort)]
        result = generate_a3b_mtp_batch(lane, requests)
        for stream, (i, budget) in zip(result.streams, cohort):
            assert_greedy_matches(model, oracle.lm, oracle.runs[i][0], oracle.runs[i][1][:budget], stream.tokens)
        assert sum(stream.accepted_drafts for stream in result.streams) > 0
