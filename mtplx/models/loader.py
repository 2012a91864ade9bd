"""Load an HF-layout checkpoint into an mlx-lm target model plus our MTP head.

mlx-lm drops `mtp.*` weights for every MTP-capable architecture, so the target is loaded through
mlx-lm with those weights set aside, and the head is built from them here.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model

from .cpu_ops import column_major_weights
from .draft_head import DraftVocab, build_draft_vocab, read_head
from .errors import CheckpointShapeError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from .mtp_head import MTPHead

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "mtplx-tiny-py"


def _text_config(config: dict) -> dict:
    """The language model's config (multimodal checkpoints nest it under `text_config`)."""
    return config.get("text_config") or config


def _architectures() -> dict[str, ModuleType]:
    from . import gemma3, qwen3, qwen3_5, qwen3_next

    table = {}
    for module in (qwen3, qwen3_5, qwen3_next, gemma3):
        for model_type in module.MODEL_TYPES:
            table[model_type] = module
    return table


@dataclass
class MTPModel:
    """A loaded checkpoint: the mlx-lm target, our MTP head (or None) and the tokenizer."""

    target: nn.Module
    mtp: Optional[MTPHead]
    tokenizer: object
    config: dict
    path: Path
    arch: ModuleType
    mtp_disabled_reason: Optional[str] = None
    eos_token_ids: frozenset = field(default_factory=frozenset)
    draft_vocab: Optional[DraftVocab] = None     # a head trained onto a reduced vocabulary (draft_head.py)

    @property
    def model_id(self) -> str:
        return self.path.name

    @property
    def text_config(self) -> dict:
        return _text_config(self.config)

    @property
    def fingerprint(self) -> str:
        """sha256[:16] of the config: what prefix states and lane routes are bound to."""
        import hashlib

        return hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def max_context(self) -> int:
        return int(self.text_config.get("max_position_embeddings") or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    def hidden(self, tokens: mx.array, cache=None) -> mx.array:
        return self.arch.hidden_states(self.target, tokens, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.arch.logits(self.target, hidden)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.arch.embed(self.target, tokens)

    def draft_hidden(self, hidden: mx.array, next_tokens: mx.array, mtp_cache) -> mx.array:
        return self.mtp(hidden, self.embed(next_tokens), mtp_cache)

    def draft_logits(self, draft_hidden: mx.array) -> mx.array:
        """The head's logits over the target's whole vocabulary: through the shared output layer,
        or a reduced draft vocabulary's (its logits at their ids, a floor elsewhere)."""
        if self.draft_vocab is not None:
            return self.draft_vocab.logits(draft_hidden)
        return self.logits(draft_hidden)

    def make_cache(self) -> list:
        make = getattr(self.arch, "make_cache", None)      # hybrids: RecurrentCache for GDN layers
        return make(self.target) if make is not None else make_prompt_cache(self.target)

    def make_mtp_cache(self) -> Optional[list]:
        """The MTP head's caches; None without a head (a prefill then primes no history)."""
        return [KVCache() for _ in self.mtp.layers] if self.mtp is not None else None


def _read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{path} has no config.json; pass an HF-layout model directory")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"{cfg_path} has no 'model_type' field")
    return config


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"could not load the tokenizer in {path}: {exc}") from exc


def _mtp_weights(path: Path, prefixes=("mtp.",)) -> dict:
    weights = {}
    for wf in sorted(glob.glob(str(path / "model*.safetensors"))):
        for k, v in mx.load(wf).items():
            prefix = next((p for p in prefixes if k.startswith(p)), None)
            if prefix is not None:
                weights[k[len(prefix):]] = v
    return weights


def _quant_params(module: nn.Module, path: str, weights: dict, default: dict) -> dict:
    """A quantized layer's bits and group size, read off its stored shapes (heads may mix
    widths, e.g. an 8-bit router beside 4-bit experts); the config's values otherwise."""
    w, s = weights.get(f"{path}.weight"), weights.get(f"{path}.scales")
    in_dims = module.weight.shape[-1]
    if w is not None and s is not None and s.shape[-1] and (w.shape[-1] * 32) % in_dims == 0 \
            and in_dims % s.shape[-1] == 0:
        return {"group_size": in_dims // s.shape[-1], "bits": w.shape[-1] * 32 // in_dims}
    return default


def _build_mtp(arch: ModuleType, args, config: dict, weights: dict, path: Optional[Path] = None,
               sanitize: bool = True) -> MTPHead:
    n_layers = int(_text_config(config).get("mtp_num_hidden_layers") or config.get("mtp_num_hidden_layers") or 1)
    if sanitize and hasattr(arch, "sanitize_mtp"):      # HF layout -> mlx layout (norms, experts)
        weights = arch.sanitize_mtp(weights, path, args)
    head = MTPHead(arch.hidden_size(args), arch.rms_norm_eps(args),
                   lambda: arch.make_mtp_block(args), num_layers=n_layers)
    if any(k.endswith(".scales") for k in weights):
        q = config.get("mtplx_mtp_quantization") or config.get("quantization") or {}
        default = {"group_size": int(q.get("group_size", 64)), "bits": int(q.get("bits", 4))}
        nn.quantize(head, class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights
                    and _quant_params(m, p, weights, default))
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CheckpointShapeError(f"MTP head weights do not match the config: {exc}") from exc
    mx.eval(head.parameters())
    return head


def _cpu_float32_experts(module: nn.Module) -> None:
    """MLX's CPU `gather_mm` (MoE experts) runs only float32 for some shapes: on the CPU device,
    unquantized expert weights of another dtype are held in float32 and each expert layer casts
    its input up and its output back, so activations keep the checkpoint's dtype."""
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return

    class Float32SwitchLinear(SwitchLinear):
        def __call__(self, x, indices, sorted_indices=False):
            return super().__call__(x.astype(mx.float32), indices, sorted_indices).astype(x.dtype)

    for _, m in module.named_modules():
        if type(m) is SwitchLinear and m.weight.dtype != mx.float32:
            m.update({k: v.astype(mx.float32) for k, v in m.parameters().items()})
            m.__class__ = Float32SwitchLinear


def _checked_checkpoint(path: Path) -> tuple:
    """(config, architecture module) of a checkpoint directory, or the load error that says why not."""
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    config = _read_config(path)
    arch = _architectures().get(config["model_type"])
    if arch is None:
        raise UnsupportedModelError(
            f"model_type {config['model_type']!r} is not supported; supported: {sorted(_architectures())}")
    if not glob.glob(str(path / "model*.safetensors")):
        raise ModelNotFoundError(f"{path} has no model*.safetensors weights")
    return config, arch


def _load_head(path: Path, arch, target, config: dict) -> tuple:
    """(the MTP head, its draft ids or None, None), or (None, None, why the checkpoint has none).
    A head stored beside the checkpoint (config.json's `mtplx_mtp_head`, `draft_head.py`) is
    already in MLX's layout, and runs in the target's dtype whatever it was stored in (a shipped
    head is stored in float16 to halve its size)."""
    stored = read_head(path, config)
    if stored is not None:
        weights, draft_ids, entry = stored
        dtype = arch.embed(target, mx.array([[0]])).dtype       # the target's activations'
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        config = dict(config, mtp_num_hidden_layers=entry.get("num_hidden_layers", 1),
                      mtplx_mtp_quantization=entry.get("quantization"))
    else:
        weights, draft_ids = _mtp_weights(path, getattr(arch, "MTP_PREFIXES", ("mtp.",))), None
    if not weights:
        return None, None, f"checkpoint {path.name} has no mtp.* weights"
    mtp = _build_mtp(arch, target.args, config, weights, path, sanitize=stored is None)
    mtp.eval()
    _cpu_float32_experts(mtp)
    return mtp, draft_ids, None


def load_model(path=None, *, load_mtp: bool = True) -> MTPModel:
    """Load a checkpoint directory; None loads the shipped default model."""
    from ..runtime import clear_streams_at_exit, warn_if_slow_blas

    warn_if_slow_blas()
    clear_streams_at_exit()
    path = Path(path) if path is not None else SHIPPED_MODEL
    config, arch = _checked_checkpoint(path)

    def classes(config):
        model_cls, args_cls = _get_classes(config)

        class Target(model_cls):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
                return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

        Target.__name__ = model_cls.__name__
        return Target, args_cls

    try:
        target, config = mlx_lm_load_model(path, get_model_classes=classes)
    except ValueError as exc:
        raise CheckpointShapeError(f"target weights in {path} do not match config.json: {exc}") from exc
    target.eval()
    if hasattr(arch, "prepare_target"):                 # hybrids: capturing GDN forward
        arch.prepare_target(target)
    _cpu_float32_experts(target)

    mtp, draft_ids, reason = _load_head(path, arch, target, config) if load_mtp \
        else (None, None, "MTP disabled by load_mtp=False")
    draft_vocab = None
    if draft_ids is not None:
        draft_vocab = build_draft_vocab(target, arch, draft_ids, int(_text_config(config)["vocab_size"]))

    column_major_weights(target)
    if mtp is not None:
        column_major_weights(mtp)
    if draft_vocab is not None:
        column_major_weights(draft_vocab.proj)
    tokenizer = _load_tokenizer(path)
    eos = config.get("eos_token_id", _text_config(config).get("eos_token_id"))
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return MTPModel(target=target, mtp=mtp, tokenizer=tokenizer, config=config, path=path, arch=arch,
                    mtp_disabled_reason=reason, eos_token_ids=frozenset(int(e) for e in eos_ids),
                    draft_vocab=draft_vocab)
