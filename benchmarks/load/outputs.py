"""`bench load`'s outputs: the tables, the chart, its section of BENCHMARKS.md and the JSON record."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List

from benchmarks.load.workload import (DEFAULT_CLIENTS, DEFAULT_TEMPERATURES, MIXED, MIXED_TEMPERATURES, MIXED_TOP_PS,
                                      SAMPLED, SHARED_TEMPERATURE, arm_label)
from benchmarks.report import ROOT, replace_section


def _fmt(v, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(record: dict) -> str:
    """The markdown table of the summary: one row per arm and server."""
    lines = ["| arm | server | tok/s | ours/peer | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
             "| E2E p95 s | errors | lane rows/cycle | drafts/row-cycle | drafts accepted % | greedy identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, entry in record["summary"].items():
        for side in ("ours", "peer"):
            s = entry[side]
            ratio = _fmt(entry["tok_s_ratio"], digits=2) if side == "ours" else ""
            same = entry.get("greedy_identical")
            same_txt = f"{same['identical']}/{same['compared']}" if same and side == "ours" else ""
            lane = (f"{_fmt(s.get('lane_occupancy'), digits=2)} | {_fmt(s.get('drafts_per_row_cycle'), digits=2)} "
                    f"| {_fmt(s.get('accepted_share'), 100)}") if side == "ours" else " |  | "
            lines.append(f"| {key} | {side} | {_fmt(s['tok_s'], digits=1)} | {ratio} | {_fmt(s['ttft_p50_s'], 1000)} "
                         f"| {_fmt(s['ttft_p95_s'], 1000)} | {_fmt(s['itl_p50_s'], 1000, 1)} "
                         f"| {_fmt(s['itl_p95_s'], 1000, 1)} | {_fmt(s['e2e_p95_s'], digits=2)} "
                         f"| {_fmt(s['errors'])} | {lane} | {same_txt} |")
    return "\n".join(lines)


def format_mixed_table(mixed: Dict[str, dict]) -> str:
    """The mixed arm per client count (see `summary.summarize_mixed`)."""
    lines = ["| clients | ours tok/s | peer tok/s | ours/peer | lane rows/cycle | steady rows/cycle "
             "| mixed/shared ours | mixed/shared peer | greedy identical (t0 requests) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in mixed.values():
        same = e.get("greedy_identical")
        same_txt = f"{same['identical']}/{same['compared']}" if same else ""
        lines.append(f"| {e['clients']} | {_fmt(e['ours_tok_s'], digits=1)} | {_fmt(e['peer_tok_s'], digits=1)} "
                     f"| {_fmt(e['ours_over_peer'], digits=2)} | {_fmt(e['lane_occupancy'], digits=2)} "
                     f"| {_fmt(e.get('steady_lane_occupancy'), digits=2)} "
                     f"| {_fmt(e['mixed_over_shared'], digits=3)} | {_fmt(e['peer_mixed_over_shared'], digits=3)} "
                     f"| {same_txt} |")
    return "\n".join(lines)


def format_logprobs_table(arms: dict) -> str:
    lines = ["| arm | tok/s without | tok/s with logprobs | with/without |", "|---|---:|---:|---:|"]
    for key, e in arms.items():
        lines.append(f"| {key} | {_fmt(e['off'], digits=1)} | {_fmt(e['on'], digits=1)} "
                     f"| {_fmt(e['on_over_off'], digits=3)} |")
    return "\n".join(lines)


def format_modes_table(modes: dict) -> str:
    lines = ["| arm | auto tok/s | mtp tok/s | ar tok/s | auto/ar | auto/mtp |", "|---|---:|---:|---:|---:|---:|"]
    for key, e in modes["arms"].items():
        lines.append(f"| {key} | {_fmt(e.get('auto'), digits=1)} | {_fmt(e.get('mtp'), digits=1)} "
                     f"| {_fmt(e.get('ar'), digits=1)} | {_fmt(e.get('auto_over_ar'), digits=3)} "
                     f"| {_fmt(e.get('auto_over_mtp'), digits=3)} |")
    drops = {k: v for k, v in modes["auto_largest_drop"].items() if v is not None}
    if not drops:       # one client count: nothing to compare
        return "\n".join(lines)
    text = ", ".join(f"{k} {_fmt(v, 100, 1)}%" for k, v in drops.items())
    return "\n".join(lines + ["", f"Largest drop of auto's tok/s from one client count to the next: {text}."])


def plot(record: dict, path: Path) -> None:
    """Throughput and TTFT p95 against closed-loop clients, both servers, each temperature (and
    the mixed arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = record["plan"]["clients"]
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for t in record["plan"]["temperatures"]:
        label = arm_label(t)
        for side, color in (("ours", "tab:blue"), ("peer", "tab:orange")):
            name = "mtplx (ours)" if side == "ours" else "mlx_lm.server"
            style = ":^" if t == MIXED else "-o" if t == 0 else "--s"
            figs = [record["summary"][f"{label}/closed-{n}"][side] for n in clients]
            ax_tput.plot(clients, [f["tok_s"] for f in figs], style, color=color, label=f"{name}, {label}")
            ax_ttft.plot(clients, [None if f["ttft_p95_s"] is None else 1000 * f["ttft_p95_s"] for f in figs],
                         style, color=color, label=f"{name}, {label}")
    for ax, title, ylabel in ((ax_tput, "completion throughput", "tok/s"),
                              (ax_ttft, "time to first token, p95", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels([str(c) for c in clients])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench load: median of {record['runs']} run(s), {record['machine']['cpu_count']} CPUs, "
                 f"{record['date'][:10]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_section(record: dict, table: str, image: str, command: str, name: str = "load") -> str:
    """The `bench:load` section of BENCHMARKS.md."""
    m, rt, peer = record["machine"], record["machine"]["runtime"], record.get("peer", {})
    n = peer.get("concurrency")
    rates = ", ".join(f"{k} {v:.2f}" for k, v in (record["per_run"][-1].get("open_rate_req_s") or {}).items())
    counts = ", ".join(f"{k}: {v}" for k, v in record["requests_per_arm"].items())
    quick = " (quick smoke run: few requests, not representative)" if record.get("quick") else ""
    variant = name[len("load-"):]
    lines = [
        f"## bench load{f' ({variant})' if variant else ''}: mtplx vs mlx_lm.server{quick}",
        "",
        f"`{command}`, {record['date']}, {record['runs']} run(s), {record['elapsed_s'] / 60:.1f} min.",
        f"Machine: `{m['platform']}`, {m['cpu_count']} CPUs, BLAS {rt.get('blas')} (`{rt.get('blas_path')}`),",
        f"mlx {rt.get('mlx_version')} on `{rt.get('mlx_device')}`, mlx-lm {rt.get('mlx_lm_version')}, "
        f"Python {rt.get('python')}. Model: {record['model']}.",
        "",
        f"Ours: `serve run {record['plan'].get('config') or 'serve_configs/config.yaml'}` on a free port" + (
            ", clients on the ingress replica's own port (`--direct-http`: Serve's direct ingress, no proxy hop)"
            if record["plan"].get("direct_http") else "") + ". Peer: `mlx_lm.server "
        f"--decode-concurrency {n} --prompt-concurrency {n}` on the same checkpoint without its `mtp.*`",
        f"tensors, with `LD_PRELOAD={peer.get('ld_preload')}`. One server at a time; runs alternate peer, ours.",
        "",
        "Streaming `/v1/completions`; Python-code prompts, every 5th about 6x longer; `max_tokens` 16-256,",
        f"fixed per request index. Closed loops at {', '.join(map(str, record['plan']['clients']))} clients; "
        f"requests per arm: {counts}.",
        f"Open loop: Poisson arrivals at {record['open_loop']['load_fraction']:.0%} of the peer's closed-loop "
        f"request rate at {record['open_loop']['capacity_clients']} clients (last run: {rates} req/s).",
        "Sampled arms send `top_p` 0.95 and `top_k` 20 to both servers and a per-request `seed` to ours only",
        "(mlx_lm.server serves a seeded request outside its batch).",
        *(_mixed_lines() if MIXED in record["plan"]["temperatures"] else ()),
        "",
        "Figures are medians over runs (errors summed); ours/peer is the median of the per-run tok/s ratios.",
        "ITL: per request, (last chunk - first chunk) / (completion tokens - 1). Lane rows/cycle: mean live",
        "rows per decode cycle of our lanes during the arm (- when the server does not report it);",
        "drafts/row-cycle: drafts per drafting row and cycle (the lanes' depth mix), and the share of them",
        "accepted. Greedy",
        "identical: same completion text on both servers for the same request index, summed over runs",
        "(one leading space ignored: mlx-lm's streaming detokenizer drops it); in the mixed arm over its",
        "temperature-0 requests only.",
        *_long_and_memory_lines(record),
        "",
        table,
        "",
        f"![bench load]({image})",
    ]
    return "\n".join(lines) + "\n"


def _long_and_memory_lines(record: dict) -> List[str]:
    """The long-prompt arm's description and each server's peak memory, when the run has them."""
    lines = []
    tokens = record["plan"].get("long_prompt_tokens")
    if tokens:
        lines.append(f"Long prompts (`{arm_label(0.0)}/long-{tokens}`): greedy requests one at a time, prompts of "
                     f"about {tokens} tokens sharing no prefix, 8 tokens each, after one unmeasured request of that "
                     "length; its TTFT is the time to first token on a long prompt.")
    peak = record.get("peak_memory_mb") or {}
    if any(peak.values()):
        lines.append(f"Peak resident memory (VmHWM of the largest process, most of any run): ours "
                     f"{_fmt(peak.get('ours'))} MB, mlx_lm.server {_fmt(peak.get('peer'))} MB.")
    return [""] + lines if lines else []


def _mixed_lines() -> List[str]:
    temps = ", ".join(f"{t:g}" for t in MIXED_TEMPERATURES)
    top_ps = ", ".join(f"{t:g}" for t in MIXED_TOP_PS)
    return [
        f"Mixed arm: each request sends one of the pairs of a temperature ({temps}) and a top_p ({top_ps}),",
        "each pair once in every block of 15 requests,",
        f"`top_k` {SAMPLED['top_k']}, to both servers; its sampled requests carry a `seed` to ours only.",
        f"Mixed/shared: the median of the per-run ratios of the mixed arm's tok/s over the "
        f"{arm_label(SHARED_TEMPERATURE)} arm's at the same client count. Steady rows/cycle: the lanes' rows",
        "per cycle from the arm's start until its first client ran out of requests (the drain after it, the",
        "last requests finishing with fewer neighbours, left out).",
    ]


def section_name(record: dict) -> str:
    """`load` for the comparison as planned by default; a run with other arms or another model
    (`load-modes`, `load-logprobs`, `load-<model dir>`, `load-ar` for `--generation-mode ar`, ...) gets a section and chart of its own, so
    that it does not replace the default comparison. Temperatures other than the default arms'
    (0, 0.6 and `mixed`) add their labels (`load-modes-t1`), and so does a comparison with only
    some of the default arms (`load-greedy`, `load-greedy-t06`, `load-t06-mixed`); other client
    counts add them (`load-modes-c1`, `load-greedy-c16`)."""
    plan, parts = record["plan"], []
    if record["model"] != "shipped":
        parts.append(re.sub(r"[^a-z0-9]+", "-", Path(record["model"]).name.lower()).strip("-") or "model")
    if plan.get("generation_mode"):
        parts.append(plan["generation_mode"])
    if plan.get("direct_http"):
        parts.append("direct")
    if plan.get("modes"):
        parts.append("modes")
    if plan.get("logprobs") is not None:
        parts.append("logprobs")
    temperatures = plan.get("temperatures", ())
    extra_arms = plan.get("modes") or plan.get("logprobs") is not None
    partial = not extra_arms and temperatures and set(temperatures) < set(DEFAULT_TEMPERATURES)
    parts += [arm_label(t).replace(".", "") for t in temperatures if partial or t not in DEFAULT_TEMPERATURES]
    if plan.get("clients") and tuple(plan["clients"]) != DEFAULT_CLIENTS:
        parts.append("c" + "-".join(str(c) for c in plan["clients"]))
    return "-".join(["load", *parts])


def write_outputs(record: dict, command: str) -> dict:
    """JSON under build/bench/, the chart under docs/, the section of BENCHMARKS.md (`bench:load`
    for the default comparison, see `section_name`)."""
    name = section_name(record)
    png = ROOT / "docs" / f"bench_{name.replace('-', '_')}.png"
    plot(record, png)
    table = format_table(record)
    if record.get("modes"):
        table += "\n\nGeneration modes (ours; `--modes`):\n\n" + format_modes_table(record["modes"])
    if record.get("mixed"):
        table += ("\n\nMixed settings (per-request temperature and top_p; mixed/shared: over ours' "
                  f"{arm_label(SHARED_TEMPERATURE)} arm):\n\n" + format_mixed_table(record["mixed"]))
    if record.get("logprobs"):
        table += (f"\n\nLogprobs (ours; `--logprobs {record['plan']['logprobs']}`):\n\n"
                  + format_logprobs_table(record["logprobs"]))
    md = ROOT / "BENCHMARKS.md"
    md.write_text(replace_section(md.read_text() if md.exists() else "", name,
                                  render_section(record, table, png.relative_to(ROOT).as_posix(), command, name)))
    record["artifacts"].update(png=str(png), markdown=str(md))
    Path(record["artifacts"]["json"]).write_text(json.dumps(record, indent=2, default=str))
    return {"table": table, **record["artifacts"]}
