"""`mtplx models add`: the registry data, the GGUF -> MLX conversion and the install's staging, on
a small gemma3 GGUF written here with the `gguf` package (no download). The real model's install
and mlx-lm's greedy text on it run only with MTPLX_REAL_MODEL_TEST=1 (about 240 MB, a minute or
more)."""

import hashlib
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mtplx.models import registry
from mtplx.models.convert_gguf import GEMMA3_LAYER_NAMES, GGUFConversionError, convert, mlx_name
from mtplx.models.install import ModelInstallError, add_model, ensure_packages, missing_requirements

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, FFN, HEADS, HEAD_DIM = 6, 64, 128, 2, 32   # 6 layers: mlx-lm's gemma3_text needs one global
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\n", "▁", "h", "e", "l", "o", "w", "r", "d", "u", "s", "m", "t", "i", "n", "a",
          "he", "ll", "llo", "hello", "▁hello", "or", "ld", "wor", "world", "▁world", "us", "er",
          "user", "mo", "de", "model", "▁t", "▁th", "▁the", "th", "in", "▁in"]
TOKENS = CONTROL + PIECES


def tiny_tensors(seed=0):
    """The GGUF tensors of a 6-layer gemma3 (float32, numpy's row-major (out, in) shapes)."""
    rng = np.random.default_rng(seed)
    t = {"token_embd.weight": rng.normal(0, 0.5, (len(TOKENS), HIDDEN)),
         "output_norm.weight": 1 + rng.normal(0, 0.1, HIDDEN)}
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (HEAD_DIM, HIDDEN), "attn_v": (HEAD_DIM, HIDDEN),
              "attn_output": (HIDDEN, HEADS * HEAD_DIM), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN), "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}
    shapes.update({k: (HIDDEN,) for k in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")})
    for i in range(LAYERS):
        for k, shape in shapes.items():
            # the file stores llama.cpp's 1 + w for every norm
            t[f"blk.{i}.{k}.weight"] = (1 + rng.normal(0, 0.1, shape)) if k.endswith("norm") \
                else rng.normal(0, 0.1, shape)
    return {k: v.astype(np.float32) for k, v in t.items()}


def write_tiny_gguf(path, tensors, *, arch="gemma3", quantized=("blk.0.ffn_up.weight", "token_embd.weight")):
    """A gemma3 GGUF as llama.cpp writes one: its metadata keys, a sentencepiece ("llama")
    vocabulary with control tokens, BOS on, and some tensors in Q8_0 (dequantized by `gguf`)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(CONTROL) + [-float(i) for i in range(len(PIECES))])
    w.add_token_types([3] * len(CONTROL) + [1] * len(PIECES))      # 3: control
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    for name, a in tensors.items():
        if name in quantized:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tensors = tiny_tensors()
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors), tensors


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    convert(tiny_gguf[0], out, dtype="float32", chat_template=registry.chat_template(registry.entry("gemma-3-270m")),
            stop_tokens=("<eos>", "<end_of_turn>"), progress=lambda s: None)
    return out


# -- the registry data -------------------------------------------------------------------------

def test_the_registry_is_data_the_install_can_act_on():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, e in registry.known_models().items():
        assert e["extra"] in extras and sorted(e["requires"]) == sorted(extras[e["extra"]]), \
            "the registry's packages are the project's optional extra"
        assert len(e["gguf"]["sha256"]) == 64 and int(e["gguf"]["sha256"], 16) >= 0
        assert (registry.CHAT_TEMPLATES_DIR / e["chat_template"]).is_file()
        assert (REPO / e["serve_config"]).is_file()
        assert e["variants"][0]["name"] == name and "quantize" not in e["variants"][0], \
            "the first variant is the float model the others are made from"
        assert all(v["quantize"]["bits"] in (2, 3, 4, 6, 8) for v in e["variants"][1:])
        assert e["notice"].startswith("Gemma is provided under and subject to the Gemma Terms of Use")
    assert "gguf>=0.17" in extras["dev"], "the conversion tests need gguf"


def test_names_resolve_to_the_models_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_MODELS_DIR", str(tmp_path))
    assert registry.models_dir() == tmp_path
    assert registry.resolve_model_path("gemma-3-270m") == str(tmp_path / "gemma-3-270m")
    assert registry.resolve_model_path("gemma-3-270m-4bit") == str(tmp_path / "gemma-3-270m-4bit")
    assert registry.resolve_model_path("/some/dir") == "/some/dir"
    assert registry.resolve_model_path(None) is None
    assert "mtplx models add gemma-3-270m" in registry.model_not_installed("gemma-3-270m-4bit")
    with pytest.raises(registry.ModelNotFoundError, match="mtplx models add gemma-3-270m"):
        registry.check_installed("gemma-3-270m")
    own = tmp_path / "elsewhere" / "gemma-3-270m"       # a user's own directory of that name
    own.mkdir(parents=True)
    assert registry.model_not_installed(str(own)) is None
    monkeypatch.delenv("MTPLX_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.models_dir() == tmp_path / "xdg" / "mtplx" / "models"


def test_the_app_builder_resolves_a_model_name(tmp_path, monkeypatch):
    from deployments.app import build_app

    monkeypatch.setenv("MTPLX_MODELS_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match="mtplx models add gemma-3-270m"):
        app = build_app({"model_path": "gemma-3-270m"})._bound_deployment
    assert app.init_args[1]["model_path"] == str(tmp_path / "gemma-3-270m")
    assert app.init_args[0]._bound_deployment.init_kwargs["model_path"] == str(tmp_path / "gemma-3-270m")


# -- the conversion ----------------------------------------------------------------------------

def test_every_gguf_name_maps_to_a_gemma3_text_parameter():
    from mlx.utils import tree_flatten
    from mlx_lm.models.gemma3_text import Model, ModelArgs

    params = {k for k, _ in tree_flatten(Model(ModelArgs(
        model_type="gemma3_text", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
        num_attention_heads=HEADS, head_dim=HEAD_DIM, num_key_value_heads=1, vocab_size=len(TOKENS))).parameters())}
    mapped = {mlx_name(k) for k in tiny_tensors()} | {mlx_name("output.weight")}
    assert mapped == params
    assert len(GEMMA3_LAYER_NAMES) * LAYERS + 3 == len(params)
    with pytest.raises(GGUFConversionError, match="rope_freqs"):
        mlx_name("rope_freqs.weight")


def test_conversion_writes_the_weights_norms_shifted_back(tiny_gguf, converted):
    import mlx.core as mx

    _, source = tiny_gguf
    weights = {k: np.array(v) for k, v in mx.load(str(converted / "model.safetensors")).items()}
    assert set(weights) == {mlx_name(k) for k in source}, "tied: no lm_head"
    for name, a in source.items():
        got = weights[mlx_name(name)]
        assert got.dtype == np.float32 and got.shape == a.shape, name
        if name.endswith("norm.weight"):
            np.testing.assert_allclose(got, a - 1, atol=1e-6, err_msg=name)   # llama.cpp's 1 + w -> w
        elif name in ("blk.0.ffn_up.weight", "token_embd.weight"):
            np.testing.assert_allclose(got, a, atol=0.01, err_msg=name)       # through Q8_0
        else:
            np.testing.assert_array_equal(got, a, err_msg=name)


def test_conversion_writes_a_gemma3_text_config(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (HIDDEN, LAYERS, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, 1, HEAD_DIM)
    assert cfg["vocab_size"] == len(TOKENS) and cfg["sliding_window"] == 16
    assert cfg["sliding_window_pattern"] == 6 and cfg["layer_types"][5] == "full_attention"
    assert cfg["rope_theta"] == 1e6 and cfg["rope_local_base_freq"] == 1e4 and cfg["query_pre_attn_scalar"] == HEAD_DIM
    assert cfg["bos_token_id"] == 2 and cfg["eos_token_id"] == [1, TOKENS.index("<end_of_turn>")]


def test_the_tokenizer_adds_bos_and_has_gemmas_chat_template(converted):
    from transformers import AutoTokenizer

    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is True and tc["bos_token"] == "<bos>" and tc["eos_token"] == "<eos>"
    tok = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    ids = tok.encode("hello world")
    assert ids[0] == 2 and ids.count(2) == 1, "Gemma needs its BOS first, once"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.encode("hello", add_special_tokens=False)[0] != 2
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nbe brief\n\nhello<end_of_turn>\n<start_of_turn>model\n"
    chat_ids = tok.encode(text, add_special_tokens=False)      # as the ingress encodes a chat prompt
    assert chat_ids[:2] == [2, TOKENS.index("<start_of_turn>")] and chat_ids.count(2) == 1


def test_the_converted_checkpoint_loads_in_mlx_lm_and_in_mtplx(converted):
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(converted))
    assert tok.bos_token_id == 2 and set(tok.eos_token_ids) == {1, TOKENS.index("<end_of_turn>")}
    assert model(mx.array([tok.encode("hello")])).shape == (1, 2, len(TOKENS))


def test_conversion_refuses_another_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "llama.gguf", tiny_tensors(), arch="llama")
    with pytest.raises(GGUFConversionError, match="only gemma3"):
        convert(path, tmp_path, progress=lambda s: None)


# -- the install: staging, idempotency, errors ---------------------------------------------------

@pytest.fixture
def tiny_registry(tiny_gguf, tmp_path, monkeypatch):
    """A registry entry for the tiny GGUF, behind an assembler package written here (the real one's
    interface: `assemble(path, overwrite)`, `EXPECTED_SHA256`, licence files under `data/`)."""
    gguf_path, _ = tiny_gguf
    sha = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    pkg = tmp_path / "pkgs" / "tiny_gemma_assembler"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "TERMS.html").write_text("<p>terms</p>")
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        import shutil
        EXPECTED_SHA256 = {sha!r}
        def assemble(output_path, overwrite=False):
            shutil.copyfile({str(gguf_path)!r}, output_path)
            return output_path
    """))
    monkeypatch.syspath_prepend(str(pkg.parent))
    entry = json.loads(json.dumps(registry.known_models()["gemma-3-270m"]))
    entry.pop("mtp_head")        # Gemma's shipped head is refused for other weights (test_train_head)
    entry.update(parameters=300_000, requires=["gguf>=0.17"], serve_config=None,
                 variants=[{"name": "tiny-gemma"}, {"name": "tiny-gemma-4bit", "quantize": {"bits": 4, "group_size": 64}}])
    entry["gguf"].update(assembler="tiny_gemma_assembler", file="tiny.gguf", sha256=sha, download_mb=1,
                         copy_files={"TERMS.html": "the terms"})
    known = tmp_path / "known_models.json"
    known.write_text(json.dumps({"tiny-gemma": entry}))
    monkeypatch.setattr(registry, "KNOWN_MODELS_FILE", known)
    monkeypatch.setenv("MTPLX_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def test_add_installs_both_variants_then_finds_them(tiny_registry):
    said = []
    paths = add_model("tiny-gemma", dtype="float32", say=said.append)
    assert paths == [tiny_registry / "tiny-gemma", tiny_registry / "tiny-gemma-4bit"]
    for p in paths:
        made = registry.installed_recipe(p)
        assert made["dtype"] == "float32" and made["recipe_version"] == registry.RECIPE_VERSION
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "NOTICE", "TERMS.html"} <= \
            {f.name for f in p.iterdir()}
        assert (p / "NOTICE").read_text().startswith("Gemma is provided under and subject to the Gemma Terms of Use")
        assert not any(f.name.startswith(".") for f in p.iterdir()), "no GGUF or staging left inside"
    q = json.loads((paths[1] / "config.json").read_text())
    assert q["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert "quantized to MLX affine 4-bit" in (paths[1] / "NOTICE").read_text()
    assert not list(tiny_registry.glob(".*.partial"))
    assert any("[3/4] converting" in s for s in said) and any("[4/4] quantizing" in s for s in said)
    rows = {r["name"]: r for r in registry.list_models()}
    assert rows["tiny-gemma"]["installed"] and rows["tiny-gemma-4bit"]["bytes"] > 0

    said.clear()
    start = time.perf_counter()
    assert add_model("tiny-gemma", dtype="float32", say=said.append) == paths
    assert time.perf_counter() - start < 5
    assert said[0].count("(already installed)") == 2 and not any("[" in s for s in said)

    import shutil

    shutil.rmtree(paths[1])                    # only the 4-bit gone: made again from the float directory
    said.clear()
    add_model("tiny-gemma", dtype="float32", say=said.append)
    assert any(s.startswith("loading") for s in said) and not any("[3/4]" in s for s in said)
    assert registry.installed_recipe(paths[1])["quantize"] == {"bits": 4, "group_size": 64}


def test_an_interrupted_install_is_redone_never_used(tiny_registry):
    base, quant = tiny_registry / "tiny-gemma", tiny_registry / "tiny-gemma-4bit"
    add_model("tiny-gemma", dtype="float32", say=lambda s: None)
    # a run killed while quantizing: a staging directory left, the variant never renamed into place
    (tiny_registry / ".tiny-gemma-4bit.partial").mkdir()
    (tiny_registry / ".tiny-gemma-4bit.partial" / "model.safetensors").write_bytes(b"half")
    import shutil

    shutil.rmtree(quant)
    # and a float directory without its marker (made by hand, or by an older mtplx)
    (base / registry.MARKER_FILE).unlink()
    said = []
    add_model("tiny-gemma", dtype="float32", say=said.append)
    assert any("left unfinished by an interrupted run" in s for s in said)
    assert any("replacing" in s for s in said) and any("[3/4]" in s for s in said)
    assert registry.installed_recipe(base) and registry.installed_recipe(quant)
    assert not list(tiny_registry.glob(".*.partial"))
    # another dtype asked for: the float variant is redone in it, and the 4-bit from it
    add_model("tiny-gemma", dtype="bfloat16", say=lambda s: None)
    assert registry.installed_recipe(base)["dtype"] == "bfloat16"
    assert registry.installed_recipe(quant)["dtype"] == "bfloat16"


def test_a_wrong_checksum_stops_the_install(tiny_registry):
    e = json.loads(registry.KNOWN_MODELS_FILE.read_text())
    e["tiny-gemma"]["gguf"]["sha256"] = "0" * 64
    registry.KNOWN_MODELS_FILE.write_text(json.dumps(e))
    with pytest.raises(ModelInstallError, match="assembles a different file"):
        add_model("tiny-gemma", dtype="float32", say=lambda s: None)
    assert not list(tiny_registry.glob("tiny-gemma*")), "nothing half-made"
    assert not list(tiny_registry.glob(".*.partial"))


def test_short_of_disk_says_what_to_do(tiny_registry):
    e = json.loads(registry.KNOWN_MODELS_FILE.read_text())
    e["tiny-gemma"]["parameters"] = 10**16                    # 40 PB in float32
    registry.KNOWN_MODELS_FILE.write_text(json.dumps(e))
    with pytest.raises(ModelInstallError, match="not enough disk space.*MTPLX_MODELS_DIR"):
        add_model("tiny-gemma", dtype="float32", say=lambda s: None)


def test_missing_packages_are_named_with_the_command_that_installs_them():
    e = registry.entry("gemma-3-270m")
    assert missing_requirements(["gguf>=0.17", "numpy>=1"]) == []
    assert missing_requirements(["gguf>=999"]) == ["gguf>=999"]
    with pytest.raises(ModelInstallError, match=r"missing packages mtplx-no-such-package==1; install "
                       r"them \(the optional extra `mtplx\[gemma\]`\): .* -m pip install 'mtplx-no-such-package==1'"):
        ensure_packages({**e, "requires": ["mtplx-no-such-package==1"]}, install=False, say=lambda s: None)


def test_pip_failing_offline_says_what_to_do(monkeypatch):
    """A real pip run that cannot reach any index (as offline): the error says how to go on."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    e = registry.entry("gemma-3-270m")
    with pytest.raises(ModelInstallError, match="Offline.*--no-index --find-links"):
        ensure_packages({**e, "requires": ["mtplx-no-such-package==1"]}, install=True, say=lambda s: None)


def test_the_cli_lists_and_reports_errors(tmp_path, monkeypatch, capsys):
    from mtplx.cli import main

    monkeypatch.setenv("MTPLX_MODELS_DIR", str(tmp_path))
    main(["models", "list", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["models_dir"] == str(tmp_path)
    assert {r["name"]: r["installed"] for r in out["models"]} == {"gemma-3-270m": False, "gemma-3-270m-4bit": False}
    main(["models", "list"])
    assert "not installed: mtplx models add gemma-3-270m" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["models", "add", "gemma-2-9b"])
    assert exc.value.code == 1
    assert "unknown model 'gemma-2-9b'; known: gemma-3-270m" in capsys.readouterr().err


# -- the real model (opt-in) ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MTPLX_REAL_MODEL_TEST"),
                    reason="set MTPLX_REAL_MODEL_TEST=1: installs Gemma 3 270M (~240 MB) and generates with mlx-lm")
def test_real_gemma_3_270m_installs_and_writes_english_in_mlx_lm():
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    paths = add_model("gemma-3-270m", say=lambda s: print(s, file=sys.stderr))
    prompt = "Once upon a time, in a small village,"
    texts = {}
    for path in paths:
        model, tok = load(str(path))
        assert tok.encode(prompt)[0] == 2
        texts[path.name] = generate(model, tok, prompt, max_tokens=24, sampler=make_sampler(0.0))
        print(path.name, repr(texts[path.name]), file=sys.stderr)
    # float32 on this CPU (measured): " there lived a man named John. He was a hard-working, honest,
    # and kind man."; the 4-bit variant: " a woman, a farmer, and a man, were living together."
    assert texts["gemma-3-270m"].startswith(" there lived a man named")
    for text in texts.values():
        words = text.split()
        assert "<start_of_image>" not in text and len(words) >= 12 and len(set(words)) >= 8
        assert sum(w.strip(".,;:!?'\"").isalpha() for w in words) >= 0.8 * len(words)


def test_the_shipped_gemma_head_names_the_weights_the_registry_installs():
    from mtplx.models import draft_head

    entry = registry.known_models()["gemma-3-270m"]
    head = json.loads((draft_head.ASSETS / entry["mtp_head"] / draft_head.ASSET_ENTRY).read_text())
    assert head["trained_on"]["source_sha256"] == entry["gguf"]["sha256"]
    assert (draft_head.ASSETS / entry["mtp_head"] / head["file"]).is_file()
    assert "Gemma Terms of Use" in (draft_head.ASSETS / entry["mtp_head"] / "NOTICE").read_text()
