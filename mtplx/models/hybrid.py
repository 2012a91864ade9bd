"""What the Qwen3-Next lineage (Qwen3-Next, Qwen3.5/3.6 dense and MoE) shares: GDN + full-attention
layers whose GDN state rolls back by capture-commit, and the HF layout of their `mtp.*` weights.

HF checkpoints (bf16, as published) store RMSNorm weights zero-centred (the norm multiplies by
1 + w) and MoE experts either one tensor per expert (`experts.{e}.{gate,up,down}_proj.weight`,
Qwen3-Next) or fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], Qwen3.5
MoE). mlx-lm converts the target's weights on load (and drops `mtp.*`); `sanitize_mtp` applies
the same conversion to the MTP head's weights. A checkpoint written by mlx-lm (converted,
possibly quantized) is already in mlx layout and passes through unchanged.
"""

from __future__ import annotations

import glob
import json
import re
import struct
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .errors import CheckpointShapeError
from .recurrent_cache import RecurrentCache, install_capture

_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")
_HEAD_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def make_cache(layers) -> list:
    return [RecurrentCache() if layer.is_linear else KVCache() for layer in layers]


def prepare_layers(layers) -> int:
    return install_capture(layers)


def checkpoint_shapes(path: Path) -> dict:
    """{tensor name: shape} from the safetensors headers, without reading any tensor."""
    shapes = {}
    for wf in sorted(glob.glob(str(Path(path) / "model*.safetensors"))):
        try:
            with open(wf, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue                      # mlx-lm reports an unreadable file when it loads it
        shapes.update({k: tuple(v.get("shape", ())) for k, v in header.items() if k != "__metadata__"})
    return shapes


def _split_fused_experts(out: dict) -> dict:
    """Fused experts (Qwen3.5 MoE): gate_up [E, 2I, H] -> gate, up; down stays [E, H, I]."""
    for key in [k for k in out if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)
        if gate_up.ndim != 3 or gate_up.shape[-2] % 2:
            raise CheckpointShapeError(f"mtp.{key} has shape {gate_up.shape}; want [experts, 2 * moe_intermediate, hidden]")
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        down = out.pop(f"{prefix}.experts.down_proj", None)
        if down is None:
            raise CheckpointShapeError(f"mtp.{prefix}.experts.gate_up_proj has no matching mtp.{prefix}.experts.down_proj")
        out[f"{prefix}.switch_mlp.down_proj.weight"] = down
    return out


def _stack_experts(out: dict, num_experts: int) -> dict:
    """One tensor per expert (Qwen3-Next): stacked along a new expert axis."""
    groups: dict = {}
    for key in [k for k in out if _EXPERT.match(k)]:
        prefix, e, proj, suffix = _EXPERT.match(key).groups()
        groups.setdefault((prefix, proj, suffix), {})[int(e)] = out.pop(key)
    for (prefix, proj, suffix), per_expert in groups.items():
        if sorted(per_expert) != list(range(num_experts)):
            raise CheckpointShapeError(
                f"mtp.{prefix}.experts.*.{proj}.{suffix}: found experts {sorted(per_expert)[:8]}... "
                f"({len(per_expert)}), the config has num_experts={num_experts}")
        out[f"{prefix}.switch_mlp.{proj}.{suffix}"] = mx.stack([per_expert[e] for e in range(num_experts)])
    return out


def sanitize_mtp(weights: dict, *, raw: bool, num_experts: int) -> dict:
    """HF -> mlx layout for the head's weights (names without the `mtp.` prefix)."""
    out = _split_fused_experts(dict(weights))
    out = _stack_experts(out, num_experts)
    if raw:
        for k, v in out.items():
            if (k in _HEAD_NORMS or k.endswith(_NORM_SUFFIXES)) and v.ndim == 1:
                out[k] = v + 1.0
    return out
