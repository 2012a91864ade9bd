"""What the ingress reads of a checkpoint without loading its weights: metadata and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[2] / "mtplx" / "assets" / "mtplx-tiny-py"


def resolve_model_dir(model_path: Optional[str]) -> Path:
    return Path(model_path).expanduser() if model_path else SHIPPED_MODEL_DIR


def load_model_metadata(model_dir: Path) -> dict:
    """Context window, vocabulary size and the sampling defaults of generation_config.json."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; pass an HF-layout model directory")
    cfg = json.loads(cfg_path.read_text())
    text_cfg = cfg.get("text_config") or {}
    max_context = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings") or 2048
    vocab = cfg.get("vocab_size") or text_cfg.get("vocab_size")
    gen_path = model_dir / "generation_config.json"
    defaults = sampler_defaults(json.loads(gen_path.read_text())) if gen_path.is_file() else {}
    return {"max_context": int(max_context), "vocab_size": int(vocab) if vocab else None,
            "sampler_defaults": defaults}


def sampler_defaults(gen: dict) -> dict:
    """The sampling fields a generation_config.json sets (do_sample false: greedy)."""
    defaults = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        if isinstance(gen.get(name), (int, float)) and not isinstance(gen.get(name), bool):
            defaults[name] = gen[name]
    if gen.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
