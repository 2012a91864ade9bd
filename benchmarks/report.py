"""Benchmark reports people can look at, shared by every `mtplx bench`: the JSON record under
`build/bench/`, a PNG chart under `docs/`, and the bench's own marked section of `BENCHMARKS.md`
(`<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`; the rest of the file is kept as it is, so each
bench rewrites only its latest figures and the machine they came from)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info() -> dict:
    """Where the figures came from: OS, cores, the live BLAS and MLX runtime, load at the start
    (the benches run side by side with whatever else the machine does)."""
    from mtplx import runtime_info

    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "runtime": runtime_info(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}



def new_record(bench: str, result: dict, command: str, model: str, options: dict, machine: dict,
               elapsed_s: float) -> dict:
    """A bench's result with what a report names: the bench, when, the command, the model, its
    options, the machine (as `machine_info()` saw it at the start) and how long it ran."""
    return {**result, "bench": bench, "date": now_iso(), "command": command, "model": model,
            "options": options, "machine": machine, "elapsed_s": elapsed_s}

def machine_line(machine: dict) -> str:
    """One markdown sentence naming the machine of a record."""
    rt = machine["runtime"]
    load = machine.get("loadavg")
    load_txt = f"; load average at start {'/'.join(f'{x:.1f}' for x in load)}" if load else ""
    if load and load[0] > machine["cpu_count"]:
        load_txt += (" (more than its cores: other jobs shared the CPUs, so single figures move by tens of "
                     "percent; ratios of arms run side by side move less)")
    return (f"Machine: `{machine['platform']}`, {machine['cpu_count']} CPUs, BLAS {rt.get('blas')} "
            f"(`{rt.get('blas_path')}`), mlx {rt.get('mlx_version')} on `{rt.get('mlx_device')}`, "
            f"mlx-lm {rt.get('mlx_lm_version')}, Python {rt.get('python')}{load_txt}.")


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the block between `<!-- bench:name -->` and `<!-- /bench:name -->` replaced by
    `body` (appended when absent); everything outside the markers is kept."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        return text[:i] + block + text[j + len(end):]
    if not text.strip():
        text = "# Benchmarks\n"
    return text.rstrip("\n") + "\n\n" + block + "\n"


def pyplot():
    """matplotlib's pyplot on the file-only backend (benches run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, categories: List[str], series: Dict[str, List[Optional[float]]], ylabel: str,
                 title: str, digits: int = 0) -> None:
    """Bars of each series side by side per category, each labelled with its value (None: no bar)."""
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(categories))]
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not pairs:
            continue
        bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width, label=label)
        ax.bar_label(bars, labels=[f"{v:.{digits}f}" for _, v in pairs], fontsize=7)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path: Path, record: dict) -> None:
    fig.suptitle(f"mtplx bench {record['bench']}: {record['model']}, {record['machine']['cpu_count']} CPUs, "
                 f"{record['date'][:10]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def write_report(record: dict, render: Callable[[dict, str], str], plot: Callable[[dict, Path], None],
                 root: Path = ROOT, name: Optional[str] = None) -> dict:
    """The record's chart (`docs/bench_NAME.png`), its section of `BENCHMARKS.md` (`render(record,
    image path relative to root)`) and the record itself (`build/bench/NAME-STAMP.json`, the
    artifacts' paths included); returns the artifacts. NAME: the bench's unless given."""
    name = name or record["bench"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    png = root / "docs" / f"bench_{name}.png"
    md = root / "BENCHMARKS.md"
    out = root / "build" / "bench" / f"{name}-{stamp}.json"
    plot(record, png)
    md.write_text(replace_section(md.read_text() if md.exists() else "", name,
                                  render(record, png.relative_to(root).as_posix())))
    record["artifacts"] = {"json": str(out), "png": str(png), "markdown": str(md)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str))
    return record["artifacts"]
