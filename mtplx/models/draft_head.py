"""An MTP head stored beside a checkpoint that shipped without one, and its draft vocabulary.

`mtplx train-head` writes the head it trained into the checkpoint directory as its own file,
`mtp_head.safetensors` (the head's `mtp.*` tensors, and `draft_ids` for a reduced vocabulary), and
one entry in `config.json`, `mtplx_mtp_head`, that says so. The target's weights are not touched:
`model*.safetensors` stay as they were, and mlx-lm (which reads only those) loads the directory
unchanged. The loader (`loader._load_head`) reads the entry.

A reduced draft vocabulary (EAGLE-3 / FR-Spec): the head projects onto K target tokens, the most
frequent in text the target wrote, through the target's own output rows for them (gathered once at
load; the file stores only their ids). Why: on a model whose output table is most of its weights
(Gemma 3 270M: 262,144 x 640, 63% of the parameters), a draft that projects onto the whole
vocabulary reads that table, which costs about as much as the target's own forward on a CPU or a
Mac. The draft's logits reach the engine over the full vocabulary (`DraftVocab.logits`): its K
logits at their target ids and DRAFT_FLOOR everywhere else, so a draft is always a target id, a
greedy draft is the argmax over the K, and a drawn draft's q is exactly zero outside them (the
acceptor's q is the distribution the draft was drawn from, so output stays exact: the verify
uses the target's whole vocabulary). The floor is finite so that a row whose grammar allows only
tokens outside the K still has a distribution to draw from (uniform over what it allows).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import CheckpointShapeError
from .registry import files_sha256

HEAD_FILE = "mtp_head.safetensors"
CONFIG_KEY = "mtplx_mtp_head"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
ASSET_ENTRY = "head.json"       # a shipped head's config entry, beside its HEAD_FILE
DRAFT_FLOOR = -1e9          # a draft logit outside the draft vocabulary: exp(floor - max) is 0 in float32


class DraftVocab:
    """A head's reduced output vocabulary: `ids` [K] (target ids, ascending) and `proj`, a
    projection onto the target's output rows for them (a plain or quantized linear layer)."""

    def __init__(self, ids: mx.array, proj: nn.Module, vocab: int):
        self.ids, self.proj, self.vocab = ids, proj, vocab

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def reduced_logits(self, hidden: mx.array) -> mx.array:
        """Logits [..., K] over the draft vocabulary (index j is target id `ids[j]`)."""
        return self.proj(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits [..., V] over the target's vocabulary: the K at their ids, DRAFT_FLOOR elsewhere."""
        reduced = self.proj(hidden)
        shape = reduced.shape[:-1]
        full = mx.full(shape + (self.vocab,), DRAFT_FLOOR, dtype=reduced.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.ids, shape + (self.size,)), reduced, axis=-1)


def output_layer(target: nn.Module, arch) -> nn.Module:
    """The target's output projection: its `lm_head`, or the embedding table when tied."""
    lm = target.language_model if hasattr(target, "language_model") else target
    head = getattr(lm, "lm_head", None)
    tied = getattr(lm, "tie_word_embeddings", None)
    if tied is None:
        tied = bool(getattr(getattr(lm, "args", None), "tie_word_embeddings", False))
    return arch.text_model(target).embed_tokens if tied or head is None else head


def rows_projection(layer: nn.Module, ids: mx.array) -> nn.Module:
    """A linear layer onto the rows `ids` of an output layer (an `nn.Linear`, `nn.Embedding` or
    their quantized forms): the same values, gathered once."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = layer.weight[ids]
        proj = nn.QuantizedLinear(layer.scales.shape[-1] * layer.group_size, int(ids.shape[0]), bias=False,
                                  group_size=layer.group_size, bits=layer.bits,
                                  **({"mode": layer.mode} if hasattr(layer, "mode") else {}))
        proj.weight, proj.scales = w, layer.scales[ids]
        if getattr(layer, "biases", None) is not None:
            proj.biases = layer.biases[ids]
        else:
            proj.pop("biases", None)
    else:
        rows = layer.weight[ids]
        proj = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        proj.weight = rows
    mx.eval(proj.parameters())
    return proj


def build_draft_vocab(target: nn.Module, arch, ids, vocab: int) -> DraftVocab:
    """The draft vocabulary of these target ids, its rows gathered from the target's output
    layer; checked once against the target's own logits (an architecture whose logits are not a
    plain projection, soft-capped say, is refused rather than drafted wrongly)."""
    ids = mx.array(sorted(int(i) for i in (ids.tolist() if isinstance(ids, mx.array) else ids)), dtype=mx.int32)
    if ids.size == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab or len(set(ids.tolist())) != ids.size:
        raise CheckpointShapeError(f"the draft vocabulary's ids must be distinct target ids below {vocab}")
    dv = DraftVocab(ids, rows_projection(output_layer(target, arch), ids), vocab)
    dtype = arch.embed(target, mx.array([[0]])).dtype          # the model's activations'
    probe = mx.random.normal((1, 1, arch.hidden_size(target.args)), key=mx.random.key(0)).astype(dtype)
    full, mine = arch.logits(target, probe)[..., ids], dv.reduced_logits(probe)
    if not mx.allclose(full.astype(mx.float32), mine.astype(mx.float32), rtol=1e-3, atol=1e-3).item():
        raise CheckpointShapeError("the target's logits are not a plain projection onto its output rows: "
                                   "a reduced draft vocabulary cannot share them")
    return dv


def read_entry(config: dict) -> Optional[dict]:
    entry = config.get(CONFIG_KEY)
    return entry if isinstance(entry, dict) else None


def read_head(path: Path, config: dict) -> Optional[tuple]:
    """(head weights without the `mtp.` prefix, draft ids or None, the entry) of a head stored
    beside the checkpoint, or None when config.json has no entry."""
    entry = read_entry(config)
    if entry is None:
        return None
    f = path / entry.get("file", HEAD_FILE)
    if not f.is_file():
        raise CheckpointShapeError(f"config.json's {CONFIG_KEY} names {f.name}, which is not in {path}")
    stored = mx.load(str(f))
    weights = {k[len("mtp."):]: v for k, v in stored.items() if k.startswith("mtp.")}
    return weights, stored.get("draft_ids"), entry


def save_head(model_dir, head: nn.Module, draft_ids=None, meta: Optional[dict] = None,
              quantize: Optional[dict] = None) -> Path:
    """Write `head` (and its draft vocabulary's ids) beside the checkpoint in `model_dir` and its
    entry in config.json (written whole to a temporary file, then renamed into place). `quantize`
    ({"bits", "group_size"}): store the head's linear layers in MLX's affine quantization."""
    model_dir = Path(model_dir)
    if quantize:
        nn.quantize(head, group_size=int(quantize["group_size"]), bits=int(quantize["bits"]),
                    class_predicate=lambda p, m: isinstance(m, nn.Linear))
    weights = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    if draft_ids is not None:
        weights["draft_ids"] = mx.array(sorted(int(i) for i in draft_ids), dtype=mx.int32)
    mx.eval(weights)
    tmp = model_dir / (HEAD_FILE + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, model_dir / HEAD_FILE)
    cfg_path = model_dir / "config.json"
    config = json.loads(cfg_path.read_text())
    entry = {"file": HEAD_FILE, "num_hidden_layers": len(head.layers),
             "draft_vocab_size": None if draft_ids is None else len(draft_ids)}
    if quantize:
        entry["quantization"] = {"group_size": int(quantize["group_size"]), "bits": int(quantize["bits"])}
    entry.update(meta or {})
    config[CONFIG_KEY] = entry
    _write_config(cfg_path, config)
    return model_dir / HEAD_FILE


def _write_config(cfg_path: Path, config: dict) -> None:
    tmp = cfg_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, cfg_path)


def update_entry(model_dir, extra: dict) -> None:
    """Add facts to the stored head's config entry."""
    cfg_path = Path(model_dir) / "config.json"
    config = json.loads(cfg_path.read_text())
    config[CONFIG_KEY] = dict(config[CONFIG_KEY], **extra)
    _write_config(cfg_path, config)


def remove_head(model_dir) -> bool:
    """Take a stored head away again (its file and config entry); whether there was one."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    config = json.loads(cfg_path.read_text())
    entry = config.pop(CONFIG_KEY, None)
    if entry is None:
        return False
    _write_config(cfg_path, config)
    (model_dir / entry.get("file", HEAD_FILE)).unlink(missing_ok=True)
    return True


def write_asset(model_dir, asset: str, notice_line: str, assets: Optional[Path] = None) -> Path:
    """Make the head trained beside `model_dir` a package asset, `assets/<asset>/` (ASSETS by
    default): HEAD_FILE with its float tensors in float16 (half the size; the loader runs a head
    in its target's dtype), its config entry as ASSET_ENTRY, the model's NOTICE with
    `notice_line` last (the line install_shipped_head adds to an installed checkpoint's NOTICE),
    and the files of the model's directory that its NOTICE names (its terms, its model card)."""
    model_dir = Path(model_dir)
    entry = read_entry(json.loads((model_dir / "config.json").read_text()))
    if entry is None:
        raise CheckpointShapeError(f"{model_dir} has no head beside it ({CONFIG_KEY} in config.json)")
    out = (assets or ASSETS) / asset
    out.mkdir(parents=True, exist_ok=True)
    stored = mx.load(str(model_dir / entry.get("file", HEAD_FILE)))
    half = {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in stored.items()}
    mx.save_safetensors(str(out / HEAD_FILE), half, metadata={"format": "mlx"})
    (out / ASSET_ENTRY).write_text(json.dumps(dict(entry, file=HEAD_FILE, stored_dtype="float16"), indent=2) + "\n")
    notice = (model_dir / "NOTICE").read_text().rstrip("\n") if (model_dir / "NOTICE").is_file() else ""
    # a checkpoint that had a shipped head installed already names it in its NOTICE
    lines = [ln for ln in notice.splitlines() if ln.strip() != notice_line.strip()]
    (out / "NOTICE").write_text("".join(ln + "\n" for ln in lines) + notice_line.strip() + "\n")
    for f in model_dir.iterdir():
        if f.is_file() and f.name in notice and f.name not in (HEAD_FILE, ASSET_ENTRY, "NOTICE", "config.json"):
            shutil.copyfile(f, out / f.name)
    return out


def install_shipped_head(model_dir, asset: str, say=print) -> bool:
    """Put a head the package ships (`mtplx/assets/<asset>/`: HEAD_FILE, its config entry in
    ASSET_ENTRY, NOTICE) beside an installed checkpoint, and its entry in config.json; a line for
    it in the checkpoint's NOTICE. False when that head is there already. The asset names the
    model it was trained on (`trained_on`: the source's SHA256, as `mtplx models add` records it
    in the directory's marker) and is refused for any other."""
    model_dir, src = Path(model_dir), ASSETS / asset
    entry = json.loads((src / ASSET_ENTRY).read_text())
    marker = model_dir / "mtplx_model.json"
    source = json.loads(marker.read_text()).get("source_sha256") if marker.is_file() else None
    if entry.get("trained_on", {}).get("source_sha256") not in (None, source):
        raise CheckpointShapeError(f"the shipped head {asset} was trained on another model than {model_dir.name}")
    digest = files_sha256([src / HEAD_FILE])
    config = json.loads((model_dir / "config.json").read_text())
    if (read_entry(config) or {}).get("sha256") == digest and (model_dir / HEAD_FILE).is_file():
        return False
    tmp = model_dir / (HEAD_FILE + ".tmp")
    shutil.copyfile(src / HEAD_FILE, tmp)
    os.replace(tmp, model_dir / HEAD_FILE)
    config[CONFIG_KEY] = dict(entry, file=HEAD_FILE, sha256=digest, installed_from=asset)
    _write_config(model_dir / "config.json", config)
    notice = model_dir / "NOTICE"
    line = (src / "NOTICE").read_text().strip().splitlines()[-1] if (src / "NOTICE").is_file() else ""
    if line and notice.is_file() and line not in notice.read_text():
        notice.write_text(notice.read_text().rstrip("\n") + "\n" + line + "\n")
    say(f"{model_dir.name}: MTP head {asset} installed ({HEAD_FILE}, config.json's {CONFIG_KEY})")
    return True
