"""The prompts a head is trained on: what leads the target into the text it will be asked to write.

The default corpus needs no download: every machine with Python has its standard library.
- chat: the user messages and templated requests of `prompts.txt` (shipped), rendered with the
  model's chat template when it has one;
- text: `prompts.txt`'s openings of plain text, and the standard library's docstrings (English
  prose about programs), cut to their first sentences;
- code: windows of the standard library's sources, starting at a line.
`--corpus PATH` adds the user's own: a text file (one prompt a line), a `.jsonl` file (objects with
"prompt", "text" or chat "messages"), or a directory of such files.
Each prompt is in the train or the held-out split, by a rule fixed per source (every 8th line of
a section of prompts.txt and every 8th topic; every 40th standard library file, as the shipped
model's training script holds out), so the acceptance report reads prompts training never saw.
"""

from __future__ import annotations

import ast
import collections
import functools
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

PROMPTS_FILE = Path(__file__).with_name("prompts.txt")
HOLDOUT_EVERY_LINE = 8        # every 8th line of a prompts.txt section, and every 8th topic, is held out
HOLDOUT_EVERY_FILE = 40       # every 40th standard library file (sorted) is held out
CODE_WINDOW_TOKENS = 48       # a code prompt: this many tokens of a source file, from a line start
DOC_PROMPT_CHARS = 160        # a docstring prompt: its first sentences, up to about this many characters
MIN_PROMPT_TOKENS = 8         # shorter prompts are dropped (training keeps this much history before the text)


@dataclass(frozen=True)
class Prompt:
    kind: str                 # "chat", "text", "code" or "user"
    ids: tuple                # token ids, BOS included where the tokenizer adds one
    source: str               # where it came from (a file and line, a prompts.txt line)


# ---------------------------------------------------------------- prompts.txt

def shipped_sections(path: Path = PROMPTS_FILE) -> dict:
    """prompts.txt's sections: name -> lines (comments and blank lines dropped)."""
    sections, name = {}, None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1]
            sections[name] = []
        elif name is not None:
            sections[name].append(line)
    return sections


def _held(index: int, every: int) -> bool:
    return index % every == every - 1


def shipped_prompts(split: str) -> Iterator[tuple]:
    """(kind, text, source) of prompts.txt in a split ("train" or "heldout")."""
    want = split == "heldout"
    s = shipped_sections()
    for kind, section in (("chat", "chat"), ("text", "text")):
        for i, line in enumerate(s.get(section, [])):
            if _held(i, HOLDOUT_EVERY_LINE) == want:
                yield kind, line, f"prompts.txt [{section}] {i}"
    for t, topic in enumerate(s.get("topics", [])):
        if _held(t, HOLDOUT_EVERY_LINE) != want:
            continue
        for j, template in enumerate(s.get("templates", [])):
            yield "chat", template.format(topic), f"prompts.txt [templates] {j} x [topics] {t}"


# ---------------------------------------------------------------- the standard library

@functools.lru_cache(maxsize=1)
def stdlib_files() -> list:
    """The standard library's own modules (tests, IDLE and 2to3 left out), in a fixed order. The
    skipped directories are pruned from the walk (the test suite alone is a third of the tree)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return [p for p in sorted(files) if 200 < p.stat().st_size < 400_000]


@functools.lru_cache(maxsize=2)
def _docstring_pool(split: str) -> list:
    """(kind, docstring opening, source) of a split's standard library files (parsing them all
    takes seconds: once a process)."""
    return [("text", doc, f"{f.name} docstring {j}") for f in stdlib_split(split)
            for j, doc in enumerate(docstring_openings(f))]


def stdlib_split(split: str) -> list:
    files = stdlib_files()
    return [p for i, p in enumerate(files) if (i % HOLDOUT_EVERY_FILE == 0) == (split == "heldout")]


def _statements(tree: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk`'s nodes in its order (breadth first), without descending into expressions:
    no definition with a docstring lives inside one, and they are most of a module's nodes."""
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.expr))
        yield node


def docstring_openings(path: Path) -> Iterator[str]:
    """The first sentences of each docstring in a source file that reads as prose."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in _statements(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            text = " ".join(doc.split())
            if len(text) < 60 or sum(c.isalpha() or c == " " for c in text) < 0.8 * len(text):
                continue                     # short, or mostly code and tables
            cut = text.find(". ", DOC_PROMPT_CHARS // 2)
            yield text[:cut + 1] if 0 < cut <= DOC_PROMPT_CHARS else text[:DOC_PROMPT_CHARS].rsplit(" ", 1)[0]


def code_windows(path: Path, tokenizer, rng: np.random.Generator, n: int) -> Iterator[list]:
    """Up to n windows of CODE_WINDOW_TOKENS tokens of a source file, each from a line start (and
    the tokenizer's BOS first, where it adds one)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text)]
    for s in rng.choice(starts, size=min(n, len(starts)), replace=False):
        ids = tokenizer.encode(text[int(s):int(s) + 8 * CODE_WINDOW_TOKENS])
        if len(ids) >= CODE_WINDOW_TOKENS:
            yield ids[:CODE_WINDOW_TOKENS]


# ---------------------------------------------------------------- the user's own

def user_texts(path: Path) -> Iterator[tuple]:
    """(kind, text or messages, source) from a user's corpus file or directory."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "messages" in obj:
                    yield "chat", obj["messages"], f"{f.name}:{i + 1}"
                else:
                    yield "user", obj.get("prompt") or obj.get("text") or "", f"{f.name}:{i + 1}"
        else:
            for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines()):
                if line.strip():
                    yield "user", line.strip(), f"{f.name}:{i + 1}"


# ---------------------------------------------------------------- assembled

def encode(tokenizer, kind: str, content) -> list:
    """Token ids of a prompt: chat through the chat template (it writes the BOS itself), anything
    else as text with the tokenizer's special tokens (Gemma's BOS)."""
    if kind == "chat" and getattr(tokenizer, "chat_template", None):
        messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(content, list):
        content = "\n".join(m.get("content", "") for m in content)
    return tokenizer.encode(content)


def _pools(split: str, user: Optional[Path]) -> dict:
    """kind -> [(kind, text or messages, source)] of a split, code aside (drawn from files)."""
    pools = {"chat": [], "text": [], "user": []}
    for kind, text, source in shipped_prompts(split):
        pools[kind].append((kind, text, source))
    pools["text"] += _docstring_pool(split)
    if user is not None:
        for i, item in enumerate(user_texts(Path(user))):
            if _held(i, HOLDOUT_EVERY_LINE) == (split == "heldout"):
                pools["user"].append(item)
    return pools


def build_prompts(tokenizer, split: str, n: int, seed: int, mix: dict, user: Optional[Path] = None) -> list:
    """n prompts of a split, drawn in the proportions of `mix` (kind -> share; "user" for the
    user's corpus), fewer where some are shorter than MIN_PROMPT_TOKENS. Deterministic for a
    seed, a tokenizer and a Python version."""
    rng = np.random.default_rng(seed)
    pools, files = _pools(split, user), stdlib_split(split)
    prompts = []
    for kind, share in mix.items():
        want = int(round(n * share))
        if kind == "code":
            for f in rng.choice(len(files), size=want, replace=True):
                ids = next(code_windows(files[int(f)], tokenizer, rng, 1), None)
                if ids is not None:
                    prompts.append(Prompt("code", tuple(ids), files[int(f)].name))
        elif pools.get(kind) and want > 0:
            order = rng.permutation(len(pools[kind]))
            for i in np.resize(order, want):                       # cycles through the pool
                k, content, source = pools[kind][int(i)]
                ids = encode(tokenizer, k, content)
                if len(ids) >= MIN_PROMPT_TOKENS:
                    prompts.append(Prompt(kind, tuple(ids), source))
    return [prompts[int(i)] for i in rng.permutation(len(prompts))]
