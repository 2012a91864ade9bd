"""A GGUF file -> an MLX checkpoint directory that mlx-lm (and so `mtplx.load_model`) loads as is.

MLX's own `mx.load` refuses k-quant tensors (Q4_K, Q6_K), so the `gguf` package dequantizes every
tensor with numpy and the weights are written as plain safetensors in one float dtype; a quantized
variant is then MLX's own affine quantization of that float model (`quantize_checkpoint`).

Only the `gemma3` architecture is mapped (to mlx-lm's `gemma3_text`); another architecture needs
its own name table and config builder here. Every name and shape is checked by loading the result
with mlx-lm, strictly, before a directory counts as converted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from .errors import ModelLoadError

# GGUF tensor names (llama.cpp's) -> mlx-lm `gemma3_text` parameter names
GEMMA3_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",           # absent when the embedding is tied (it is, in every Gemma 3)
}
GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp writes every Gemma RMSNorm weight as `1 + w` (its norm multiplies by the weight);
# mlx-lm's gemma3_text, like the original checkpoint, stores `w` and multiplies by `1 + w`.
GEMMA_NORM_SHIFT = 1.0

# metadata key (after "tokenizer.ggml.") -> the name transformers' GGUF tokenizer builders read
TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}

WEIGHTS_FILE = "model.safetensors"


class GGUFConversionError(ModelLoadError):
    """The file is not one this converter maps (architecture, tensor names, metadata)."""


def read_metadata(reader) -> dict:
    """Every metadata field of an open `gguf.GGUFReader` as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def mlx_name(gguf_name: str) -> str:
    """The mlx-lm `gemma3_text` parameter a GGUF tensor becomes; unknown names are refused, so a
    file with tensors this table does not know never converts into a model missing them."""
    stem, _, kind = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in GEMMA3_LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{GEMMA3_LAYER_NAMES[m.group(2)]}.{kind}"
    if stem in GEMMA3_NAMES:
        return f"{GEMMA3_NAMES[stem]}.{kind}"
    raise GGUFConversionError(f"no gemma3_text parameter for the GGUF tensor {gguf_name!r}")


def is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


def gemma3_config(meta: dict, *, tied: bool, dtype: str, stop_ids: list) -> dict:
    """`config.json` for mlx-lm's `gemma3_text` (and transformers' Gemma3TextConfig) from the
    file's metadata. Where the file is silent (older llama.cpp writes neither the local RoPE base
    nor the layer pattern), llama.cpp's own constants for Gemma 3 apply: a local RoPE base of
    10,000, every 6th layer global, and the query scale 1/sqrt(head_dim) except the 27B (62
    layers), which scales by 1/sqrt(hidden / heads)."""
    if meta.get("general.architecture") != "gemma3":
        raise GGUFConversionError(f"architecture {meta.get('general.architecture')!r}: only gemma3 converts")
    g = {k[len("gemma3."):]: v for k, v in meta.items() if k.startswith("gemma3.")}
    layers, hidden, heads = int(g["block_count"]), int(g["embedding_length"]), int(g["attention.head_count"])
    head_dim = int(g.get("attention.key_length", hidden // heads))
    pattern = sliding_pattern(g.get("attention.sliding_window_pattern", 6), layers)
    scaling = None
    if g.get("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g["rope.scaling.type"], "factor": float(g["rope.scaling.factor"])}
    tok = meta.get("tokenizer.ggml.tokens") or []
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(g["feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(g.get("vocab_size", len(tok))),
        "max_position_embeddings": int(g.get("context_length", 32768)),
        "rope_theta": float(g.get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(g.get("rope.freq_base_swa", 10_000.0)),
        "rope_scaling": scaling,
        "sliding_window": int(g.get("attention.sliding_window", 512)),
        "sliding_window_pattern": pattern,
        # transformers >= 4.53 reads the pattern from here
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_ids,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
    }


def sliding_pattern(value, layers: int) -> int:
    """mlx-lm's `sliding_window_pattern` (every n-th layer global) from the file's: a number, or
    one flag per layer (true: sliding), which must then follow such a period."""
    if isinstance(value, int):
        return value
    flags = [bool(f) for f in value]
    period = next((i + 1 for i, f in enumerate(flags) if not f), len(flags) + 1)
    if len(flags) != layers or flags != [(i + 1) % period != 0 for i in range(layers)]:
        raise GGUFConversionError(f"sliding-window layers {flags}: not every n-th layer global, as "
                                  f"gemma3_text needs")
    return period


def dequantized_tensors(reader, progress: Callable[[str], None] = lambda s: None) -> Dict[str, np.ndarray]:
    """Every tensor as float32 numpy under its mlx-lm name, the norms shifted back to `w`."""
    import gguf

    out = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        a = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # the reader gives a dense tensor's numpy shape, a quantized one's shape in bytes: after
        # dequantizing, ggml's shape reversed is the row-major (out, in) shape mlx-lm expects
        a = a.reshape(tuple(int(d) for d in reversed(t.shape)))
        if is_norm(t.name):
            a = a - np.float32(GEMMA_NORM_SHIFT)
        out[mlx_name(t.name)] = a
        if (i + 1) % 50 == 0 or i + 1 == n:
            progress(f"dequantized {i + 1}/{n} tensors")
    return out


def build_tokenizer(meta: dict):
    """The fast tokenizer the metadata describes, through transformers' GGUF tokenizer builders
    (transformers' own GGUF reader imports torch, so the metadata comes from `gguf` here). Gemma
    needs its BOS first: when the file says `add_bos_token`, the tokenizer.json itself adds it, so
    every consumer (transformers of any version, mlx-lm, `tokenizers` alone) does."""
    from tokenizers import processors

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:                      # transformers 4.x keeps it here
        from transformers.integrations.ggml import convert_gguf_tokenizer

    td = {name: meta[f"tokenizer.ggml.{key}"] for key, name in TOKENIZER_KEYS.items()
          if f"tokenizer.ggml.{key}" in meta}
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], td)
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos = td["tokens"][td["bos_token_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, td["bos_token_id"])])
    return backend


def tokenizer_files(meta: dict, chat_template: Optional[str], stop_tokens: list) -> Dict[str, dict]:
    """`tokenizer_config.json`, `special_tokens_map.json` and `generation_config.json`."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    special = {k: v for k, v in special.items() if v is not None}
    config = {
        # "GemmaTokenizer" is the tokenizers-backed class in transformers 5 and resolves to
        # GemmaTokenizerFast in 4.x: either loads tokenizer.json, no sentencepiece model needed
        "tokenizer_class": "GemmaTokenizer" if "gemma" in meta["general.architecture"] else "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 32768)),
        **special,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    stop_ids = stop_token_ids(meta, stop_tokens)
    generation = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": stop_ids,
                  "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    return {"tokenizer_config.json": config, "special_tokens_map.json": special,
            "generation_config.json": generation}


def stop_token_ids(meta: dict, stop_tokens: list) -> list:
    """The ids of the stop tokens (by text), the file's own EOS first; a token the vocabulary
    lacks is an error, not a silent no-stop."""
    tokens = meta["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    missing = [t for t in stop_tokens if t not in index]
    if missing:
        raise GGUFConversionError(f"stop tokens {missing} are not in the vocabulary")
    ids = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    return ids + [index[t] for t in stop_tokens if index[t] not in ids]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path, out_dir, *, dtype: str = "float32", chat_template: Optional[str] = None,
            stop_tokens: tuple = (), progress: Callable[[str], None] = print):
    """Write an MLX checkpoint directory (config, weights in `dtype`, tokenizer) from a GGUF file
    into `out_dir` (which must exist), check it loads in mlx-lm strictly, and return the loaded
    (model, config) so that a quantized variant can be made from it without reading it again."""
    import gguf
    import mlx.core as mx

    out_dir = Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    stop_ids = stop_token_ids(meta, list(stop_tokens))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = gemma3_config(meta, tied=tied, dtype=dtype, stop_ids=stop_ids)
    progress(f"dequantizing {len(reader.tensors)} tensors ({meta.get('general.name', 'model')}, "
             f"{config['num_hidden_layers']} layers, vocabulary {config['vocab_size']:,}) to {dtype}")
    arrays = dequantized_tensors(reader, progress)
    del reader
    weights = {}
    for name in list(arrays):
        weights[name] = mx.array(arrays.pop(name)).astype(getattr(mx, dtype))
    mx.save_safetensors(str(out_dir / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    n_params = sum(w.size for w in weights.values())
    del weights
    write_json(out_dir / "config.json", config)
    progress(f"wrote {n_params:,} parameters; building the tokenizer from the file's metadata")
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    for name, obj in tokenizer_files(meta, chat_template, list(stop_tokens)).items():
        write_json(out_dir / name, obj)
    return check_loads(out_dir)


def check_loads(model_dir):
    """Load the directory with mlx-lm, every weight matched to a parameter of the right shape
    (strict), and run one forward on the BOS token: its logits must be finite."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, config = load_model(Path(model_dir), strict=True)
    logits = model(mx.array([[int(config.get("bos_token_id") or 0)]]))
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise GGUFConversionError(f"{model_dir}: the converted model's logits are not finite")
    return model, config


def quantize_checkpoint(model, config: dict, out_dir, *, bits: int, group_size: int) -> None:
    """MLX affine quantization of a loaded float model into `out_dir` (weights and config only),
    mlx-lm's way: `quantize_model` writes the `quantization` block of config.json that its loader
    rebuilds the quantized layers from. Checked by loading it back."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, qconfig = quantize_model(model, dict(config), group_size=group_size, bits=bits)
    save_model(Path(out_dir), model)
    save_config(qconfig, Path(out_dir) / "config.json")
    check_loads(out_dir)
