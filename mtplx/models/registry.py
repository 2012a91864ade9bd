"""The models `mtplx models add` knows how to install, and where installed ones live.

The registry itself is data (`known_models.json` beside this file): each entry names the packages
that carry the model, its source file and SHA256, its licence notice, its chat template and stop
tokens, and the variants (directories) an install writes. Nothing here imports MLX, so the
application builder resolves a model name without loading a model.

Installed models live under `$MTPLX_MODELS_DIR`, by default `$XDG_CACHE_HOME/mtplx/models` (that
is, `~/.cache/mtplx/models`): they are derived data that one command rebuilds, so a cache
directory is their place (as the Hugging Face hub's `~/.cache/huggingface`); they stay outside
any checkout, so weights are never committed; and every process of the same user (a Ray replica
included) finds them at the same path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from .errors import ModelLoadError, ModelNotFoundError

KNOWN_MODELS_FILE = Path(__file__).with_name("known_models.json")
CHAT_TEMPLATES_DIR = Path(__file__).with_name("chat_templates")
# written last into a converted directory: what made it. A directory without it, or made by
# another recipe, is never used as finished.
MARKER_FILE = "mtplx_model.json"
# bump when a conversion's output changes, so that directories made before are redone
RECIPE_VERSION = 1


class UnknownModelError(ModelLoadError):
    """A name the registry does not know."""


def files_sha256(paths) -> str:
    """SHA256 over these files' bytes, in order (one file: its own SHA256): an assembled GGUF
    against the registry's pin, a shipped head, the target weights train-head must not change."""
    import hashlib

    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def known_models() -> dict:
    return json.loads(KNOWN_MODELS_FILE.read_text())


def entry(name: str) -> dict:
    models = known_models()
    if name not in models:
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(sorted(models))} "
                                f"(`mtplx models list`)")
    return {"name": name, **models[name]}


def chat_template(e: dict) -> Optional[str]:
    return (CHAT_TEMPLATES_DIR / e["chat_template"]).read_text() if e.get("chat_template") else None


def models_dir() -> Path:
    explicit = os.environ.get("MTPLX_MODELS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "mtplx" / "models"


def variant_of(name: str) -> Optional[tuple]:
    """(registry entry, variant) for an installable directory name, e.g. `gemma-3-270m-4bit`."""
    for model, e in known_models().items():
        for v in e["variants"]:
            if v["name"] == name:
                return {"name": model, **e}, v
    return None


def installed_recipe(path: Path) -> Optional[dict]:
    """What made a finished directory (its marker), or None when it is not one."""
    try:
        return json.loads((Path(path) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def resolve_model_path(path_or_name):
    """A model directory for what a user wrote: an existing path as is, a registered model's
    name as its directory under `models_dir()` (installed or not: the loader then says it is
    missing, and `model_not_installed` says how to install it), anything else unchanged."""
    if path_or_name is None:
        return None
    s = str(path_or_name)
    if Path(s).expanduser().exists() or variant_of(s) is None:
        return s
    return str(models_dir() / s)


def model_not_installed(path_or_name) -> Optional[str]:
    """A hint when `path_or_name` is (or resolves to) a registered model's directory under
    `models_dir()` that is not a finished install; None otherwise (a directory elsewhere is the
    user's own, whatever its name)."""
    target = Path(resolve_model_path(path_or_name)).expanduser().resolve()
    found = variant_of(target.name)
    if found is None or target.parent != models_dir().resolve() or (target / MARKER_FILE).is_file():
        return None
    return (f"the model {target.name} is not installed under {models_dir()}: "
            f"run `mtplx models add {found[0]['name']}`")


def check_installed(path_or_name) -> str:
    """The directory to load for `path_or_name`, or ModelNotFoundError with the command that
    installs it when it is a registered model not installed here."""
    hint = model_not_installed(path_or_name)
    if hint:
        raise ModelNotFoundError(hint)
    return resolve_model_path(path_or_name)


def list_models() -> list:
    """One row per installable directory: name, model, status, path, size on disk."""
    rows = []
    for model, e in known_models().items():
        for v in e["variants"]:
            path = models_dir() / v["name"]
            recipe = installed_recipe(path)
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if recipe else 0
            rows.append({"name": v["name"], "model": model, "title": e["title"], "license": e["license"],
                         "installed": recipe is not None, "path": str(path), "bytes": size,
                         "dtype": (recipe or {}).get("dtype"), "quantize": v.get("quantize")})
    return rows
