"""`bench load`'s workload, deterministic per request index and identical for both servers: the
prompts, the budgets, the arms' sampling settings, the arrivals of the open loop."""

from __future__ import annotations

import random
from typing import List, Union


# Short prompts: the opening lines of a Python function or class, for the model to continue.
SNIPPETS = (
    "import os\nimport sys\n\n\ndef walk_files(root, suffix='.py'):\n"
    "    \"\"\"Yield the paths under root whose names end with suffix.\"\"\"\n    for dirpath, dirnames, filenames in",
    "class LRUCache:\n    \"\"\"A mapping that forgets the least recently used key.\"\"\"\n\n"
    "    def __init__(self, maxsize=128):\n        self.maxsize = maxsize\n        self.data =",
    "def parse_header(line):\n    \"\"\"Split a 'Key: value' header line into a (key, value) pair.\"\"\"\n"
    "    if ':' not in line:\n        raise ValueError('not a header: %r' % (line,))\n    key, value =",
    "import re\n\n_word = re.compile(r'\\w+')\n\n\ndef count_words(text):\n"
    "    \"\"\"Return a dict mapping each word in text to its count.\"\"\"\n    counts = {}\n    for",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):\n"
    "        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n    def pop(self):",
    "def read_config(path, defaults=None):\n    \"\"\"Read an INI file and return a dict of its sections.\"\"\"\n"
    "    import configparser\n    parser = configparser.ConfigParser()\n    parser.read(path)\n    result =",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"
    "    if n < 0:\n        raise ValueError('n must be non-negative')\n    a, b = 0, 1\n    for",
    "    def __repr__(self):\n        \"\"\"Return a string that shows the class name and fields.\"\"\"\n"
    "        args = ', '.join('%s=%r' % (k, v) for k, v in sorted(self.__dict__.items()))\n        return",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef dump_state(obj, path):\n"
    "    \"\"\"Write obj to path as JSON, atomically.\"\"\"\n    tmp = path + '.tmp'\n    with open(tmp, 'w') as f:",
    "if __name__ == '__main__':\n    import argparse\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    "    parser.add_argument('paths', nargs='*')\n    args = parser.parse_args()\n    for path in",
)
LONG_EVERY = 5          # every 5th request (index % 5 == 4) carries a long prompt
LONG_FACTOR = 6         # ... made of 6 snippets
MIN_TOKENS, MAX_TOKENS = 16, 256
SAMPLED = {"top_p": 0.95, "top_k": 20}   # sent explicitly to both servers at temperature > 0
OPEN_LOOP_LOAD = 0.7    # open-loop arrival rate as a fraction of the peer's capacity ...
CAPACITY_CLIENTS = 8    # ... measured as its closed-loop request rate at this client count
DEFAULT_CLIENTS = (1, 8, 16, 32)      # closed-loop client counts of the default comparison
MIXED = "mixed"         # the mixed-settings arm, as it stands in a list of temperatures and as its label
MIXED_TEMPERATURES = (0.0, 0.2, 0.6, 0.7, 1.0)   # the mixed arm's requests: each pair of a temperature ...
MIXED_TOP_PS = (1.0, 0.95, 0.9)                  # ... and a top_p once in every 15 (`mixed_settings`)
SHARED_TEMPERATURE = 0.6   # the arm of one shared sampled setting that the mixed arm is measured against
DEFAULT_TEMPERATURES = (0.0, 0.6, MIXED)         # its arms: greedy, t0.6, mixed settings

Arm = Union[float, str]   # a temperature, or MIXED


def prompt_for(index: int) -> str:
    """The prompt of request `index`: one snippet, or LONG_FACTOR consecutive snippets joined
    (rotated by index, so long prompts differ from each other) for every LONG_EVERY-th request."""
    n = len(SNIPPETS)
    if index % LONG_EVERY == LONG_EVERY - 1:
        return "\n\n\n".join(SNIPPETS[(index + k) % n] for k in range(LONG_FACTOR))
    return SNIPPETS[index % n]


LONG_ARM_REQUESTS, LONG_ARM_TOKENS = 4, 8     # the long-prompt arm: requests, max_tokens each
CHARS_PER_TOKEN = 3     # about, for these code snippets under the tokenizers benched (usage reports the truth)


def long_prompt_for(index: int, tokens: int) -> str:
    """A prompt of about `tokens` tokens: snippets from one rotated by `index` on, repeated as
    needed (prompts of different indices share no prefix)."""
    n, parts = len(SNIPPETS), []
    while sum(len(p) for p in parts) < tokens * CHARS_PER_TOKEN:
        parts.append(SNIPPETS[(index + len(parts)) % n])
    return "\n\n\n".join(parts)


def budget_for(index: int) -> int:
    """`max_tokens` of request `index`: 16..256, a fixed permutation (97 is coprime to 241), so
    any run of consecutive indices spreads over the whole range."""
    span = MAX_TOKENS - MIN_TOKENS + 1
    return MIN_TOKENS + (index * 97) % span


def mixed_settings(index: int) -> tuple:
    """(temperature, top_p) of request `index` of the mixed arm: pair j = (i + i // 15) % 15 of
    the 15 (temperature j % 5, top_p j // 5), so each pair occurs once in every block of 15
    requests, consecutive requests take different temperatures (a run of a few requests is not
    all greedy), and the order turns by one from block to block, so that the long prompts (every
    LONG_EVERY-th request) meet every pair."""
    n = len(MIXED_TEMPERATURES) * len(MIXED_TOP_PS)
    j = (index + index // n) % n
    return MIXED_TEMPERATURES[j % len(MIXED_TEMPERATURES)], MIXED_TOP_PS[j // len(MIXED_TEMPERATURES)]


def request_body(index: int, temperature: Arm, model: str, send_seed: bool, seed_base: int = 1000) -> dict:
    """The streaming /v1/completions body of request `index` of the arm at `temperature`: greedy
    at 0, SAMPLED's top_p / top_k above 0; MIXED is the mixed arm (`mixed_settings`: its own
    temperature and top_p, with SAMPLED's top_k, always sent). A sampled request carries `seed` when
    `send_seed` (ours); a greedy one never does."""
    if temperature == MIXED:
        t, top_p = mixed_settings(index)
        sampling = {"temperature": t, "top_p": top_p, "top_k": SAMPLED["top_k"]}
    else:
        t = temperature
        sampling = {"temperature": t, **(SAMPLED if t > 0 else {})}
    body = {"model": model, "prompt": prompt_for(index), "max_tokens": budget_for(index), **sampling,
            "stream": True, "stream_options": {"include_usage": True}}
    if t > 0 and send_seed:
        body["seed"] = seed_base + index
    return body


def parse_temperatures(text: str) -> List[Arm]:
    """`--temperatures`: comma-separated numbers (0 is greedy) and the word `mixed`."""
    out: List[Arm] = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() == MIXED:
            out.append(MIXED)
            continue
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--temperatures: {item!r} is neither a number nor {MIXED!r}") from None
    return out


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> List[float]:
    """Send times (s from the arm's start) of n Poisson arrivals at rate_rps, from a seeded RNG
    so both servers meet the same schedule."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        out.append(t)
    return out


def closed_loop_requests(clients: int, per_client: int, minimum: int) -> int:
    """Requests in a closed-loop arm: per_client per client, at least `minimum`."""
    return max(minimum, per_client * clients)


def arm_label(temperature: Arm) -> str:
    if temperature == MIXED:
        return MIXED
    return "greedy" if temperature == 0 else f"t{temperature:g}"
