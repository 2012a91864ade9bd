"""Prefix-cache events, from a replica's bank to the router's index.

A replica's `PrefixCacheLog` numbers every state its prefix bank stores or drops, by the state's
name (`mtplx.api.prefix_hashes.state_hash`). Each cohort call tells the replica how far the
calling ingress has read that replica's log (`seqs()`), and the call's stream carries what came
after (`since`): the rows' own states (banked while they prefill, before their first token) and
any other change. So the router knows of a conversation's banked turn by the time the turn's
client has its answer, with no polling. A stream that is too far behind gets the names the bank
holds now instead (a reset).

The ingress's `PrefixIndex` applies what the streams bring, in each replica's order (several
streams of one replica may carry the same events: each is applied once), keeps at most
`max_names` names per replica (the least recently stored leave first), and answers how many
leading tokens of a prompt each replica holds (`held`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Dict, Iterable, List, Optional

from mtplx.api.prefix_hashes import held_prefix, prompt_hashes, state_hash

LOG_EVENTS = 4096            # a replica's log: a stream further behind gets a reset
MAX_NAMES = 65536            # names the router keeps per replica (~1 MB)


class PrefixCacheLog:
    """A replica's prefix-cache events (`on_change` is the bank's listener); thread-safe."""

    def __init__(self, block: int, max_events: int = LOG_EVENTS):
        self.block = int(block)
        self._lock = threading.Lock()
        self._events: deque = deque(maxlen=max_events)     # (seq, stored, name)
        self._held: Dict[int, int] = {}                    # name -> entries holding it
        self.seq = 0

    def on_change(self, stored: bool, salt: Optional[str], key: tuple, whole: bool) -> None:
        name = state_hash(key, whole, self.block, salt)
        if name is None:
            return
        with self._lock:
            self.seq += 1
            self._events.append((self.seq, stored, name))
            n = self._held.get(name, 0) + (1 if stored else -1)
            if n > 0:
                self._held[name] = n
            else:
                self._held.pop(name, None)

    def since(self, seq: int) -> Optional[dict]:
        """What a stream that has passed on events up to `seq` sends next: None (nothing new),
        {"block", "from", "events": [(stored, name), ...]} (events from seq + 1 on), or, when the
        log no longer reaches back that far (or seq < 0: a reader new to this replica),
        {"block", "seq", "reset": [names held now]}."""
        with self._lock:
            if seq >= self.seq:
                return None
            if seq < 0 or not self._events or self._events[0][0] > seq + 1:
                return {"block": self.block, "seq": self.seq, "reset": list(self._held)}
            out: List[tuple] = []
            for s, stored, name in reversed(self._events):
                if s <= seq:
                    break
                out.append((stored, name))
            out.reverse()
            return {"block": self.block, "from": seq + 1, "events": out}

    def stats(self) -> dict:
        with self._lock:
            return {"events": self.seq, "names_held": len(self._held), "block_tokens": self.block}


class PrefixIndex:
    """The router's view of every replica's prefix cache (see the module docstring)."""

    def __init__(self, max_names: int = MAX_NAMES):
        self.max_names = int(max_names)
        self._names: Dict[str, "OrderedDict[int, None]"] = {}
        self._seq: Dict[str, int] = {}
        self._block: Dict[str, int] = {}

    def seqs(self) -> Dict[str, int]:
        """How far this index has read each replica's log (a cohort call sends it along)."""
        return dict(self._seq)

    def apply(self, replica: str, update: Optional[dict]) -> None:
        if not update:
            return
        self._block[replica] = int(update["block"])
        if "reset" in update:
            if update["seq"] <= self._seq.get(replica, -1):
                return
            self._names[replica] = OrderedDict.fromkeys(update["reset"][-self.max_names:])
            self._seq[replica] = int(update["seq"])
            return
        names = self._names.setdefault(replica, OrderedDict())
        applied = self._seq.get(replica, -1)
        if update["from"] > applied + 1 and applied >= 0:
            return       # a gap: cannot happen (each stream starts where this index stood); skip
        for k, (stored, name) in enumerate(update["events"]):
            seq = update["from"] + k
            if seq <= applied:
                continue
            if stored:
                names[name] = None
                names.move_to_end(name)
                if len(names) > self.max_names:
                    names.popitem(last=False)
            else:
                names.pop(name, None)
            applied = seq
        self._seq[replica] = applied

    def forget(self, replica: str) -> None:
        """A replica that left: its cache left with it."""
        self._names.pop(replica, None)
        self._seq.pop(replica, None)
        self._block.pop(replica, None)

    def held(self, prompt: tuple, salt: Optional[str], replicas: Iterable[str]) -> Dict[str, int]:
        """For each replica, how many leading tokens of `prompt` (in partition `salt`) its prefix
        cache holds, as far as its events said."""
        out, names_by_block = {}, {}
        for r in replicas:
            names, block = self._names.get(r), self._block.get(r)
            if not names or not block:
                out[r] = 0
                continue
            if block not in names_by_block:
                names_by_block[block] = prompt_hashes(prompt, block, salt)
            out[r] = held_prefix(len(prompt), block, names_by_block[block], names)
        return out

    def size(self, replica: str) -> int:
        return len(self._names.get(replica, ()))
