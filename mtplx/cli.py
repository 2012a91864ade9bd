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


def _bench(a):
    from benchmarks.cli import run   # the library never imports the benchmarks but here, on demand

    run(a)


def add_load_options(p) -> None:
    """The options only `bench load` takes, shared by `mtplx bench load` and `python -m
    benchmarks.load` (here, so that building this parser imports nothing heavy)."""
    p.add_argument("--temperatures", default=None,
                   help="comma-separated arms: temperatures (0 greedy) and `mixed`, the arm of per-request "
                        "temperature and top_p (default 0,0.6,mixed)")
    p.add_argument("--requests-per-client", type=int, default=None, help="closed-loop requests per client (6)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="closed-loop requests per arm at least, whatever the clients (12)")
    p.add_argument("--open-requests", type=int, default=None, help="requests in the open-loop arm (48; 0: none)")
    p.add_argument("--modes", default=None,
                   help="ours only: closed-loop arms twice per generation_mode (mirrored order; one client: "
                        "request by request), e.g. auto,mtp,ar")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="ours only: closed-loop arms without and with logprobs: K, alternated")
    p.add_argument("--config", default=None,
                   help="ours: the serve config to run (default serve_configs/config.yaml; --model still sets "
                        "its model_path)")
    p.add_argument("--long-prompt-tokens", type=int, default=None, metavar="N",
                   help="also an arm of greedy requests one at a time with prompts of about N tokens "
                        "(time to first token on long prompts)")


def add_structured_options(p) -> None:
    """The options only `bench structured` takes."""
    p.add_argument("--duration", type=float, default=None, help="seconds per arm (20; --quick: 4)")
    p.add_argument("--served", action="store_true", help="also through `serve run` (response_format json_schema), "
                                                         "closed loops of --clients clients")
    p.add_argument("--served-only", action="store_true", help="only the served arms")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="served: /v1/completions (code prompts, the default) or /v1/chat/completions")
    p.add_argument("--blas-threads", type=int, default=1, help="in process: BLAS threads (1, as a replica)")


def main(argv=None):
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
    b = sub.add_parser("bench", help="benchmarks: solo, lane, service, http, load, soak, structured, exactness, "
                                     "sessions")
    b.add_argument("what", choices=("solo", "lane", "service", "http", "load", "soak", "structured", "exactness",
                                    "sessions"))
    b.add_argument("--model", default=None)
    b.add_argument("--tokens", type=int, default=None, help="tokens a row (structured: max_tokens, 96)")
    b.add_argument("--prompts", type=int, default=8, help="solo, exactness: prompts; service, http: rows of the "
                                                          "cohort")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--json", action="store_true", help="one JSON line")
    b.add_argument("--no-child", action="store_true", help="skip the BLAS-off child run")
    b.add_argument("--no-report", action="store_true",
                   help="solo/lane/service/http/structured: print only; no JSON record, chart or "
                        "BENCHMARKS.md section")
    b.add_argument("--quick", action="store_true", help="load: 1 run, clients 1,8, greedy only, few requests; "
                                                        "soak: 100 requests, 15 s of overload; "
                                                        "structured: 1 round of 4 s per arm; "
                                                        "sessions: 1 run, power_of_two and affinity only")
    b.add_argument("--runs", type=int, default=3, help="load: runs per server, turns interleaved; sessions: runs "
                                                       "of every arm, rotated")
    b.add_argument("--clients", default=None, help="load: closed-loop client counts, e.g. 1,8,16,32; "
                                                   "structured --served: 1,8")
    b.add_argument("--direct-http", action="store_true", help="load, soak: clients call the ingress replica on its "
                                                              "own port (Serve's direct ingress), not the proxy")
    add_load_options(b.add_argument_group("load only"))
    add_structured_options(b.add_argument_group("structured only"))
    b.set_defaults(func=_bench)
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
    a.command_line = " ".join(["mtplx", *(sys.argv[1:] if argv is None else argv)])
    a.func(a)


if __name__ == "__main__":
    main()
